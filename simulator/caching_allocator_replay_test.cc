// CachingAllocatorModel against PyTorch's real CUDA caching allocator.
//
// simulator/testdata/allocator holds allocation sequences (memsim's own runs of five
// models, written by `memsim simulate --snapshot-history run` and
// tools/gpu/snapshot_events.py, and two seeded random ones from
// tools/gpu/synthetic_events.py) and what PyTorch 2.11's allocator did with them on an
// H200 (tools/gpu/measure.py allocator): every change of reserved memory and the event
// where it happened, the peaks, the segments at the end; and the same on a device capped
// below the peak reserved, where the allocator releases its cache, retries and may run
// out of memory; with where cudaMalloc put each segment (Note [Segment addresses]). Under
// the default settings and six PYTORCH_CUDA_ALLOC_CONF settings, the model must do exactly
// the same.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "simulator/caching_allocator_model.h"

namespace memsim {
namespace {

constexpr char kDataDir[] = "simulator/testdata/allocator/";
constexpr char kMeasured[] = "h200_torch2.11.json";
// The same sequences under other PYTORCH_CUDA_ALLOC_CONF settings, as the names say.
constexpr char kMeasuredMaxSplit[] = "h200_torch2.11_max_split_size_mb_128.json";
constexpr char kMeasuredMaxNonSplitRounding[] =
    "h200_torch2.11_max_split_size_mb_128_max_non_split_rounding_mb_512.json";
constexpr char kMeasuredExpandable[] = "h200_torch2.11_expandable_segments_True.json";
constexpr char kMeasuredGarbageCollection[] =
    "h200_torch2.11_garbage_collection_threshold_0_6.json";
// roundup_power2_divisions:4 and roundup_power2_divisions:[256:1,512:2,1024:4,>:8].
constexpr char kMeasuredRoundup4[] = "h200_torch2.11_roundup_power2_divisions_4.json";
constexpr char kMeasuredRoundupList[] = "h200_torch2.11_roundup_power2_divisions_list.json";

struct Event {
  char kind;      // 'a' allocate, 'f' free, 'e' empty_cache()
  int64_t value;  // bytes for 'a', allocation index for 'f'
};

// Reads an event file (format: tools/gpu/snapshot_events.py), gzip-compressed.
std::vector<Event> ReadEvents(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> in(popen(("gzip -dc '" + path + "'").c_str(), "r"), pclose);
  std::vector<Event> events;
  if (!in) return events;
  char line[128];
  while (std::fgets(line, sizeof(line), in.get()) != nullptr) {
    if (line[0] == '#' || line[0] == '\n') continue;
    Event e{line[0], 0};
    if (e.kind == 'a' || e.kind == 'f') {
      e.value = std::stoll(line + 2);
    } else if (e.kind != 'e') {
      throw std::runtime_error(path + ": unknown event '" + line + "'");
    }
    events.push_back(e);
  }
  return events;
}

// What the model does with `events` on a device of `capacity_bytes` (0: unlimited), in the
// shape of the measurement. `segment_addresses`, if given, places the model's segments in
// order of creation.
nlohmann::json Replay(const std::vector<Event>& events, CachingAllocatorConfig config,
                      const nlohmann::json* segment_addresses = nullptr) {
  size_t next_segment = 0;
  if (segment_addresses != nullptr) {
    config.segment_address = [&](int64_t) {
      return segment_addresses->at(next_segment++).get<int64_t>();
    };
  }
  CachingAllocatorModel model(config);
  std::vector<int64_t> block_of_allocation;
  nlohmann::json changes = nlohmann::json::array();
  int64_t reserved = 0;
  int64_t oom_event = -1;
  for (size_t i = 0; i < events.size(); ++i) {
    const Event& e = events[i];
    if (e.kind == 'a') {
      std::optional<CachingAllocatorModel::Allocation> allocation;
      try {
        allocation = model.Malloc(e.value);
      } catch (const std::invalid_argument& error) {
        // The model asked for a segment where the driver's run had one live: it diverged
        // earlier, which the reserved changes so far show.
        return {{"error", "event " + std::to_string(i) + ": " + error.what()},
                {"reserved_changes", changes}};
      }
      if (!allocation) {
        oom_event = static_cast<int64_t>(i);
        break;
      }
      block_of_allocation.push_back(allocation->block_id);
    } else if (e.kind == 'f') {
      model.Free(block_of_allocation.at(static_cast<size_t>(e.value)));
    } else {
      model.EmptyCache();
    }
    if (model.stats().reserved_bytes != reserved) {
      reserved = model.stats().reserved_bytes;
      changes.push_back({static_cast<int64_t>(i), reserved});
    }
  }
  nlohmann::json segments = nlohmann::json::array();
  for (const AllocatorSegmentView& s : model.Segments()) {
    segments.push_back({s.size_bytes, s.pool == PoolKind::kSmall ? "small" : "large"});
  }
  std::sort(segments.begin(), segments.end());
  const AllocatorStats& stats = model.stats();
  return {{"oom_event", oom_event},
          {"reserved_changes", changes},
          {"peak_allocated_bytes", stats.peak_allocated_bytes},
          {"peak_reserved_bytes", stats.peak_reserved_bytes},
          {"allocated_bytes_at_end", stats.allocated_bytes},
          {"reserved_bytes_at_end", stats.reserved_bytes},
          {"num_alloc_retries", stats.num_alloc_retries},
          {"segments_at_end", segments}};
}

nlohmann::json Measured(const char* file) {
  std::ifstream in(std::string(kDataDir) + file);
  return nlohmann::json::parse(in).at("sequences");
}

// `settings` with the run's capacity: the capped runs set a memory fraction.
CachingAllocatorConfig ConfigOf(const nlohmann::json& run, CachingAllocatorConfig settings = {}) {
  settings.capacity_bytes = run.value("allowed_bytes", int64_t{0});
  settings.capacity_is_fraction = true;
  return settings;
}

// Calls check(name, run, events, runs, real) for every measured replay (`runs`: all of the
// sequence's).
// Expects the model's replay to equal the GPU's in every field.
void ExpectSame(const nlohmann::json& model, const nlohmann::json& real, const std::string& what) {
  // The first reserved change that differs says where the model went astray.
  const nlohmann::json& ours = model.at("reserved_changes");
  const nlohmann::json& theirs = real.at("reserved_changes");
  for (size_t i = 0; i < std::min(ours.size(), theirs.size()); ++i) {
    if (ours[i] != theirs[i]) {
      ADD_FAILURE() << what << ": reserved change " << i << " is " << ours[i]
                    << " in the model and " << theirs[i] << " on the GPU";
      break;
    }
  }
  if (model.contains("error")) {
    ADD_FAILURE() << what << ": " << model["error"].get<std::string>();
    return;
  }
  for (const auto& [key, value] : model.items()) {
    EXPECT_TRUE(value == real.at(key)) << what << ": " << key;
  }
}

using ReplayCheck = std::function<void(const std::string& name, const std::string& run,
                                       const std::vector<Event>& events, const nlohmann::json& runs,
                                       const nlohmann::json& real)>;
void ForEachReplay(const char* file, const ReplayCheck& check) {
  const nlohmann::json measured = Measured(file);
  ASSERT_EQ(measured.size(), 7u);
  for (const auto& [name, runs] : measured.items()) {
    const std::vector<Event> events = ReadEvents(kDataDir + name + ".events.gz");
    ASSERT_EQ(static_cast<int64_t>(events.size()), runs.at("unlimited").at("events").get<int64_t>())
        << name;
    for (const auto& [run, real] : runs.items()) check(name, run, events, runs, real);
  }
}

// Expects every replay of `file`, measured under the PYTORCH_CUDA_ALLOC_CONF that `settings`
// models, to match; with each run's own segment addresses unless the segments are
// expandable (their addresses are offsets in the model's own range).
void ExpectEveryReplayMatches(const char* file, const CachingAllocatorConfig& settings) {
  int compared = 0;
  ForEachReplay(
      file, [&](const std::string& name, const std::string& run, const std::vector<Event>& events,
                const nlohmann::json&, const nlohmann::json& real) {
        const nlohmann::json* addresses =
            settings.expandable_segments ? nullptr : &real.at("new_segment_addresses");
        ExpectSame(Replay(events, ConfigOf(real, settings), addresses), real, name + ", " + run);
        ++compared;
      });
  EXPECT_EQ(compared, 21);
}

TEST(CachingAllocatorReplay, MatchesPyTorchGivenTheDriversSegmentAddresses) {
  ExpectEveryReplayMatches(kMeasured, {});
}

// Note [Oversize blocks].
TEST(CachingAllocatorReplay, MaxSplitSizeMatchesPyTorch) {
  CachingAllocatorConfig settings;
  settings.max_split_size_bytes = int64_t{128} << 20;
  ExpectEveryReplayMatches(kMeasuredMaxSplit, settings);
  settings.max_non_split_rounding_bytes = int64_t{512} << 20;
  ExpectEveryReplayMatches(kMeasuredMaxNonSplitRounding, settings);
}

// Note [Expandable segments].
TEST(CachingAllocatorReplay, ExpandableSegmentsMatchPyTorch) {
  CachingAllocatorConfig settings;
  settings.expandable_segments = true;
  ExpectEveryReplayMatches(kMeasuredExpandable, settings);
}

// Note [Garbage collection threshold]. It acts on the capped replays only.
TEST(CachingAllocatorReplay, GarbageCollectionThresholdMatchesPyTorch) {
  CachingAllocatorConfig settings;
  settings.garbage_collection_threshold = 0.6;
  ExpectEveryReplayMatches(kMeasuredGarbageCollection, settings);
}

// Note [Rounding to power-of-two divisions], with the divisions PyTorch parses from "4" and
// from "[256:1,512:2,1024:4,>:8]" (tools/lib/megatron_args_test.cc).
TEST(CachingAllocatorReplay, RoundupPower2DivisionsMatchPyTorch) {
  CachingAllocatorConfig settings;
  settings.roundup_power2_divisions.fill(4);
  ExpectEveryReplayMatches(kMeasuredRoundup4, settings);
  settings.roundup_power2_divisions = {1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8};
  ExpectEveryReplayMatches(kMeasuredRoundupList, settings);
}

// memsim's own placement (each segment above the last) against the GPU's. Measured: the
// peak reserved is exact in 14 of the 21 replays; the largest differences are +0.08% on
// the Mixtral run and up to +3.6% on the random sequences, and every out-of-memory
// verdict is right (two of them at a later event).
TEST(CachingAllocatorReplay, DefaultPlacementStaysWithinTheMeasuredBounds) {
  ForEachReplay(kMeasured, [&](const std::string& name, const std::string& run,
                               const std::vector<Event>& events, const nlohmann::json&,
                               const nlohmann::json& real) {
    const nlohmann::json model = Replay(events, ConfigOf(real));
    const double ours = model["peak_reserved_bytes"].get<double>();
    const double theirs = real["peak_reserved_bytes"].get<double>();
    const bool random = name.rfind("random_", 0) == 0;
    EXPECT_LE(std::abs(ours - theirs) / theirs, random ? 0.04 : 0.001) << name << ", " << run;
    EXPECT_EQ(model["oom_event"] == -1, real["oom_event"] == -1) << name << ", " << run;
  });
}

}  // namespace
}  // namespace memsim
