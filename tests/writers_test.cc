// Timeline replay and the writers: traces checked against the real tracer's schema,
// snapshots read back with Python's pickle module, summaries against hand-worked bytes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>

#include "simulator/peak_analysis.h"
#include "simulator/session.h"
#include "simulator/snapshot_writer.h"
#include "simulator/summary_writer.h"
#include "simulator/timeline.h"
#include "simulator/trace_writer.h"
#include "tests/support/test_mlp.h"

namespace memsim {
namespace {

constexpr int64_t kMiB = 1 << 20;

// Two iterations of the test MLP (B=4, I=16, H=32, C=8, fp32) on meta.
struct MlpRun {
  MlpRun() : session(FindGpu("H100-80GB")) {
    ActiveSession active(session);
    loss = RunTestMlpTraining(TestMlpConfig{}, &session);
  }
  Session session;
  at::Tensor loss;
};

TEST(Timeline, StaticMemoryIsRoundedParametersStateAndInputs) {
  MlpRun run;
  const Timeline timeline = Timeline::Replay(run.session.recorder());
  ASSERT_EQ(timeline.iterations().size(), 2u);
  // Parameters 32x16, 32, 8x32, 8 floats = 2048, 128, 1024, 32 B; each block rounds up to
  // a multiple of 512: 2048 + 512 + 1024 + 512 = 4096. Adam keeps two more copies: 8192.
  // Input x (4x16 floats, 256 B) and targets (4 int64, 32 B) take 512 each.
  EXPECT_EQ(timeline.iterations()[0].static_allocated_bytes, 3 * 4096 + 1024);
  // Iteration 1 also starts with iteration 0's loss alive (4 B -> 512).
  EXPECT_EQ(timeline.iterations()[1].static_allocated_bytes, 3 * 4096 + 1024 + 512);
  // After each optimizer step the same is alive: state, inputs and that iteration's loss.
  EXPECT_EQ(timeline.iterations()[0].end_allocated_bytes, 3 * 4096 + 1024 + 512);
  EXPECT_EQ(timeline.iterations()[1].end_allocated_bytes, 3 * 4096 + 1024 + 512);
  // Everything is in one 2 MiB small-pool segment.
  EXPECT_EQ(timeline.peak_reserved_bytes(), 2 * kMiB);
  const int64_t last = timeline.num_points() - 1;
  EXPECT_GT(timeline.time_s(last), 0.0);  // the virtual clock ran
}

TEST(Timeline, LargeRequestsReserveSegmentsAsTheCachingAllocatorDoes) {
  Session session;
  {
    ActiveSession active(session);
    at::Tensor a = at::empty({kMiB + 1}, at::TensorOptions().device(at::kMeta).dtype(at::kByte));
    at::Tensor b = at::empty({5 * kMiB}, at::TensorOptions().device(at::kMeta).dtype(at::kByte));
    at::Tensor c = at::empty({16 * kMiB}, at::TensorOptions().device(at::kMeta).dtype(at::kByte));
  }
  const Timeline timeline = Timeline::Replay(session.recorder());
  // a: 1 MiB + 1 B rounds to 1 MiB + 512 in a new 20 MiB segment; b fits in the rest of
  // it; c (16 MiB) does not fit in the 14 MiB - 512 left, and being >= 10 MiB gets a
  // segment of exactly its size.
  EXPECT_EQ(timeline.point(0).allocated_bytes, kMiB + 512);
  EXPECT_EQ(timeline.point(0).reserved_bytes, 20 * kMiB);
  EXPECT_EQ(timeline.point(1).reserved_bytes, 20 * kMiB);
  EXPECT_EQ(timeline.point(2).reserved_bytes, 36 * kMiB);
  EXPECT_EQ(timeline.peak_allocated_bytes(), kMiB + 512 + 5 * kMiB + 16 * kMiB);
  EXPECT_EQ(timeline.peak_requested_bytes(), 22 * kMiB + 1);  // all three alive
  // Frees keep segments cached: reserved stays 36 MiB after everything is freed.
  EXPECT_EQ(timeline.point(timeline.num_points() - 1).allocated_bytes, 0);
  EXPECT_EQ(timeline.point(timeline.num_points() - 1).reserved_bytes, 36 * kMiB);
  // On a 30 MiB device the third allocation fails (no cached segment is entirely free),
  // although only 22 MiB + 1024 B are ever allocated: reserved memory decides.
  const CapacityReplay small = ReplayWithCapacity(session.recorder(), 30 * kMiB);
  EXPECT_EQ(small.oom_event, 2);
  EXPECT_FALSE(small.fits());
  EXPECT_EQ(small.allocated_bytes_at_oom, kMiB + 512 + 5 * kMiB);
  EXPECT_EQ(small.reserved_bytes_at_oom, 20 * kMiB);
  const CapacityReplay enough = ReplayWithCapacity(session.recorder(), 36 * kMiB);
  EXPECT_TRUE(enough.fits());
  EXPECT_EQ(enough.peak_reserved_bytes, 36 * kMiB);
}

// A step whose unlimited replay reserves more than the device has can still fit: PyTorch
// releases cached segments and retries before it fails. The verdict is the capacity
// replay's, and its peak reserved memory never exceeds the capacity (so "fits" never
// comes with negative headroom).
// Reserved memory is kept only where it changes: every point between the changes, and each
// iteration's reserved peak, must still read what the allocator held after that event.
TEST(Timeline, ReservedMemoryReadsRightBetweenItsChanges) {
  Session session;
  {
    ActiveSession active(session);
    const auto bytes = at::TensorOptions().device(at::kMeta).dtype(at::kByte);
    session.BeginIteration(0);
    at::Tensor a = at::empty({5 * kMiB}, bytes);  // event 0: a 20 MiB segment
    at::Tensor b = at::empty({kMiB + 1}, bytes);  // event 1: 1 MiB + 512 from its rest
    b.reset();                                    // event 2
    a.reset();                                    // event 3: both cached, 20 MiB held
    session.EndIteration();
    session.BeginIteration(1);
    session.EmptyCache();                     // releases the free 20 MiB segment
    at::Tensor c = at::empty({1024}, bytes);  // event 4: a 2 MiB small segment
    at::Tensor d = at::empty({1024}, bytes);  // event 5: in the same segment
    c.reset();                                // event 6
    d.reset();                                // event 7
    session.EndIteration();
  }
  const Timeline timeline = Timeline::Replay(session.recorder());
  ASSERT_EQ(timeline.num_points(), 8);
  const int64_t reserved[] = {20 * kMiB, 20 * kMiB, 20 * kMiB, 20 * kMiB,
                              2 * kMiB,  2 * kMiB,  2 * kMiB,  2 * kMiB};
  const int64_t allocated[] = {5 * kMiB, 6 * kMiB + 512, 5 * kMiB, 0, 1024, 2048, 1024, 0};
  for (int64_t e = 0; e < 8; ++e) {
    EXPECT_EQ(timeline.point(e).reserved_bytes, reserved[e]) << "event " << e;
    EXPECT_EQ(timeline.point(e).allocated_bytes, allocated[e]) << "event " << e;
  }
  ASSERT_EQ(timeline.iterations().size(), 2u);
  EXPECT_EQ(timeline.iterations()[0].peak_reserved_bytes, 20 * kMiB);
  // The second iteration starts after the cache was emptied: 2 MiB, not the 20 before it.
  EXPECT_EQ(timeline.iterations()[1].peak_reserved_bytes, 2 * kMiB);
  EXPECT_EQ(timeline.peak_reserved_bytes(), 20 * kMiB);
}

// Allocated memory is kept in 32-bit counts of 512 bytes while it fits (2 TiB); a point past
// that moves every point to bytes, and none may change on the way.
TEST(Timeline, AllocatedMemoryPastTwoTebibytesReadsExactly) {
  constexpr int64_t kTiB = int64_t{1} << 40;
  Session session;
  {
    ActiveSession active(session);
    const auto bytes = at::TensorOptions().device(at::kMeta).dtype(at::kByte);
    at::Tensor a = at::empty({1000}, bytes);      // event 0: a 1024-byte block
    at::Tensor b = at::empty({3 * kTiB}, bytes);  // event 1: a 3 TiB block of its own
    b.reset();                                    // event 2
    at::Tensor c = at::empty({513}, bytes);       // event 3: 1024 bytes
  }
  const Timeline timeline = Timeline::Replay(session.recorder());
  ASSERT_EQ(timeline.num_points(), 6);  // and the frees of a and c
  const int64_t allocated[] = {1024, 1024 + 3 * kTiB, 1024, 2048, 1024, 0};
  for (int64_t e = 0; e < 6; ++e) {
    EXPECT_EQ(timeline.AllocatedAfter(e), allocated[e]) << "event " << e;
  }
  EXPECT_EQ(timeline.peak_allocated_bytes(), 1024 + 3 * kTiB);
  EXPECT_EQ(timeline.iterations()[0].peak_allocated_bytes, 1024 + 3 * kTiB);
}

TEST(Timeline, FitsAfterReleasingTheCacheAsPyTorchDoes) {
  Session session;
  {
    ActiveSession active(session);
    auto bytes = [](int64_t n) {
      return at::empty({n}, at::TensorOptions().device(at::kMeta).dtype(at::kByte));
    };
    at::Tensor a = bytes(12 * kMiB);  // its own 12 MiB segment
    a.reset();                        // cached, not released
    at::Tensor b = bytes(14 * kMiB);  // does not fit the cached 12 MiB: a 14 MiB segment
  }
  const Timeline unlimited = Timeline::Replay(session.recorder());
  EXPECT_EQ(unlimited.peak_reserved_bytes(), 26 * kMiB);
  const CapacityReplay on_20 = ReplayWithCapacity(session.recorder(), 20 * kMiB);
  EXPECT_TRUE(on_20.fits());
  EXPECT_EQ(on_20.peak_reserved_bytes, 14 * kMiB);
  const CapacityReplay on_13 = ReplayWithCapacity(session.recorder(), 13 * kMiB);
  EXPECT_EQ(on_13.oom_event, 2);  // b, after releasing a's segment: 14 > 13 MiB
  EXPECT_EQ(on_13.reserved_bytes_at_oom, 12 * kMiB);
  // Above the device's capacity unlimited, so the shortcut must replay: same answers.
  EXPECT_EQ(ReplayWithCapacity(session.recorder(), 20 * kMiB, unlimited).peak_reserved_bytes,
            14 * kMiB);
  EXPECT_EQ(ReplayWithCapacity(session.recorder(), 13 * kMiB, unlimited).oom_event, 2);
}

// The shortcut through the unlimited replay answers exactly what a replay on the device
// answers, on both sides of the unlimited peak (where it replays) and at it (where it
// reads the answer off the unlimited replay).
TEST(Timeline, CapacityShortcutAgreesWithTheFullReplay) {
  MlpRun run;
  const Recorder& recorder = run.session.recorder();
  const Timeline unlimited = Timeline::Replay(recorder);
  const int64_t peak = unlimited.peak_reserved_bytes();
  ASSERT_EQ(peak, 2 * kMiB);  // one small-pool segment holds every tensor of the MLP
  for (const int64_t capacity : {peak / 2, peak - 1, peak, peak + 1, 2 * peak}) {
    const CapacityReplay full = ReplayWithCapacity(recorder, capacity);
    const CapacityReplay shortcut = ReplayWithCapacity(recorder, capacity, unlimited);
    EXPECT_EQ(shortcut.oom_event, full.oom_event) << capacity;
    EXPECT_EQ(shortcut.peak_reserved_bytes, full.peak_reserved_bytes) << capacity;
    EXPECT_EQ(shortcut.allocated_bytes_at_oom, full.allocated_bytes_at_oom) << capacity;
    EXPECT_EQ(shortcut.reserved_bytes_at_oom, full.reserved_bytes_at_oom) << capacity;
  }
  EXPECT_TRUE(ReplayWithCapacity(recorder, peak, unlimited).fits());
  EXPECT_FALSE(ReplayWithCapacity(recorder, peak / 2, unlimited).fits());
}

TEST(TraceWriter, MatchesTheRealTracerSchema) {
  MlpRun run;
  const Timeline timeline = Timeline::Replay(run.session.recorder());
  const nlohmann::json trace = nlohmann::json::parse(TraceText(timeline, TraceOptions{}));
  ASSERT_EQ(trace.size(), 2u);
  for (const char* key : {"0", "1"}) {
    const nlohmann::json& it = trace.at(key);
    EXPECT_EQ(it.size(), 4u);
    EXPECT_EQ(it.at("theoretical_memory_MB").get<double>(), -1.0);
    double max_allocated = 0;
    double last_time = -1;
    for (const nlohmann::json& sample : it.at("samples")) {
      EXPECT_EQ(sample.size(), 3u);
      max_allocated = std::max(max_allocated, sample.at("allocated_memory_MB").get<double>());
      EXPECT_GE(sample.at("reserved_memory_MB").get<double>(),
                sample.at("allocated_memory_MB").get<double>());
      EXPECT_GE(sample.at("timestamp_s").get<double>(), last_time);
      last_time = sample.at("timestamp_s").get<double>();
    }
    EXPECT_EQ(max_allocated, it.at("peak_allocated_MB").get<double>());
  }
  EXPECT_EQ(trace["0"]["static_memory_MB"].get<double>(), 13312.0 / kMiB);
  EXPECT_EQ(trace["0"]["samples"][0]["allocated_memory_MB"].get<double>(), 13312.0 / kMiB);
}

// The trace is written as text as it goes; it must be exactly what the document, parsed and
// dumped by nlohmann::json with an indent of 1, is: numbers formatted alike, keys in
// std::map's order (with 11 iterations "10" sorts before "2"), thinned or not.
TEST(TraceWriter, TextIsTheJsonDocumentsDump) {
  TestMlpConfig config;
  config.iterations = 11;
  Session session(FindGpu("H100-80GB"));
  {
    ActiveSession active(session);
    RunTestMlpTraining(config, &session);
  }
  const Timeline timeline = Timeline::Replay(session.recorder());
  TraceOptions thin;
  thin.sample_interval_s = 1e-6;
  thin.theoretical_memory_mb = 1234.5;
  for (const TraceOptions& options : {TraceOptions{}, thin}) {
    const std::string text = TraceText(timeline, options);
    const nlohmann::json document = nlohmann::json::parse(text);
    ASSERT_EQ(document.size(), 11u);
    EXPECT_EQ(text, document.dump(1));
    EXPECT_LT(text.find("\n \"10\": "), text.find("\n \"2\": "));
  }
}

TEST(TraceWriter, ThinningKeepsThePeak) {
  MlpRun run;
  const Timeline timeline = Timeline::Replay(run.session.recorder());
  TraceOptions thin;
  thin.sample_interval_s = 1.0;  // longer than the whole run: one bucket per iteration
  const nlohmann::json trace = nlohmann::json::parse(TraceText(timeline, thin));
  const nlohmann::json full = nlohmann::json::parse(TraceText(timeline, TraceOptions{}));
  for (const char* key : {"0", "1"}) {
    const auto& samples = trace[key]["samples"];
    EXPECT_LE(samples.size(), 7u);  // start sample + at most 6 kept per bucket
    EXPECT_LT(samples.size(), full[key]["samples"].size());
    double max_allocated = 0;
    for (const auto& s : samples)
      max_allocated = std::max(max_allocated, s["allocated_memory_MB"].get<double>());
    EXPECT_EQ(max_allocated, trace[key]["peak_allocated_MB"].get<double>());
  }
}

TEST(TraceWriter, WritesAtomicallyAndReportsUnwritableFolders) {
  MlpRun run;
  const Timeline timeline = Timeline::Replay(run.session.recorder());
  const std::string dir = ::testing::TempDir() + "/memsim_trace_test";
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(WriteTrace(dir + "/memory_trace_rank0.json", timeline, TraceOptions{}).ok());
  std::ifstream in(dir + "/memory_trace_rank0.json");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}),
            TraceText(timeline, TraceOptions{}));
  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    files += entry.is_regular_file();
  EXPECT_EQ(files, 1u);  // no temporary left behind

  const Status status =
      WriteTrace("/proc/memsim_cannot_write/trace.json", timeline, TraceOptions{});
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("/proc/memsim_cannot_write"), std::string::npos);
}

TEST(SnapshotWriter, PythonPickleReadsWhatMemoryVizNeeds) {
  MlpRun run;
  const Recorder& recorder = run.session.recorder();
  const Timeline timeline = Timeline::Replay(recorder);
  const std::string dir = ::testing::TempDir() + "/memsim_snapshot_test";
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/snapshot.pickle";
  ASSERT_TRUE(WriteSnapshot(path, recorder, timeline.peak_event(), SnapshotOptions{}).ok());
  EXPECT_EQ(std::string(SnapshotPickle(recorder, 0, {}).substr(0, 2)), "\x80\x02");  // protocol 2

  // An independent reader: Python's pickle, with no torch. It checks the keys
  // memory_viz reads and prints totals that the replay must agree with.
  const std::string script = dir + "/check.py";
  std::ofstream(script) << R"PY(
import pickle, sys
s = pickle.load(open(sys.argv[1], 'rb'))
assert set(s) >= {'segments', 'device_traces'}, s.keys()
allocated = reserved = 0
for seg in s['segments']:
    for k in ('device', 'address', 'total_size', 'allocated_size', 'active_size', 'stream', 'segment_type', 'blocks'):
        assert k in seg, k
    assert seg['total_size'] == sum(b['size'] for b in seg['blocks'])
    reserved += seg['total_size']
    for b in seg['blocks']:
        assert b['state'] in ('active_allocated', 'inactive'), b['state']
        if b['state'] == 'active_allocated':
            allocated += b['size']
            assert len(b['frames']) == 3 and {'filename', 'line', 'name'} <= set(b['frames'][0])
actions = {e['action'] for e in s['device_traces'][0]}
assert actions <= {'alloc', 'free_requested', 'free_completed', 'segment_alloc', 'segment_free'}, actions
assert {'alloc', 'segment_alloc'} <= actions
print(allocated, reserved, len(s['device_traces'][0]))
)PY";
  FILE* pipe = popen(("python3 " + script + " " + path).c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  char buffer[256] = {};
  const bool read = fgets(buffer, sizeof(buffer), pipe) != nullptr;
  ASSERT_EQ(pclose(pipe), 0) << buffer;
  ASSERT_TRUE(read);
  long long allocated = 0, reserved = 0, entries = 0;
  ASSERT_EQ(sscanf(buffer, "%lld %lld %lld", &allocated, &reserved, &entries), 3);
  EXPECT_EQ(allocated, timeline.peak_allocated_bytes());
  EXPECT_EQ(reserved, 2 * kMiB);
  // One segment_alloc, then per event an alloc or a free_requested + free_completed.
  int64_t expected_entries = 1;
  for (int64_t e = 0; e <= timeline.peak_event(); ++e) {
    expected_entries += recorder.events()[static_cast<size_t>(e)].is_alloc ? 1 : 2;
  }
  EXPECT_EQ(entries, expected_entries);
}

TEST(Summary, BreaksThePeakDownByCategory) {
  MlpRun run;
  const Recorder& recorder = run.session.recorder();
  const Timeline timeline = Timeline::Replay(recorder);
  const PeakAnalysis peak = AnalyzePeak(recorder, timeline, 5);
  // Parameters: (512 + 32 + 256 + 8) floats = 3232 B; Adam state twice that.
  EXPECT_EQ(peak.bytes_by_category[static_cast<size_t>(Category::kParameter)], 3232);
  EXPECT_EQ(peak.bytes_by_category[static_cast<size_t>(Category::kOptimizerState)], 6464);
  EXPECT_EQ(peak.largest_storages.size(), 5u);
  const nlohmann::json summary = SummaryJson(recorder, timeline, peak, SummaryContext{});
  EXPECT_EQ(summary["peak_allocated_MB"].get<double>(),
            BytesToMiB(timeline.peak_allocated_bytes()));
  EXPECT_EQ(summary["breakdown_at_peak_MB"]["parameters"].get<double>(), BytesToMiB(3232));
  EXPECT_EQ(summary["largest_tensors_at_peak"].size(), 5u);
  EXPECT_TRUE(summary["phases"].contains("backward"));
}

}  // namespace
}  // namespace memsim

namespace memsim {
namespace {

// PyTorch's own memory_viz (Debian's python3-torch 1.13 ships the older _memory_viz whose
// `stats` reads a bare list of segments and asserts each segment's total_size equals its
// blocks' sizes) accepts memsim's segments and finds the same totals. Skipped where that
// Python has no torch.
TEST(SnapshotWriter, OneReplayWritesThePeakAndTheStepSnapshotsAsTwoReplaysDo) {
  MlpRun run;
  const Recorder& recorder = run.session.recorder();
  const Timeline timeline = Timeline::Replay(recorder);
  const int64_t last = static_cast<int64_t>(recorder.events().size()) - 1;
  const int64_t peak = timeline.peak_event();
  ASSERT_GT(peak, 0);
  ASSERT_LT(peak, last);
  SnapshotOptions step;
  step.first_traced_event = timeline.iterations().back().begin_event;
  SnapshotOptions segments;
  segments.segments_only = true;
  // The peak before the step's event (as simulate writes them), and after it.
  for (const int64_t through : {last, peak - 1}) {
    std::ostringstream step_sink, peak_sink;
    StreamSnapshotAndPeak(recorder, through, step, &step_sink, peak, &peak_sink);
    EXPECT_EQ(step_sink.str(), SnapshotPickle(recorder, through, step)) << through;
    EXPECT_EQ(peak_sink.str(), SnapshotPickle(recorder, peak, segments)) << through;
  }
}

TEST(SnapshotWriter, PyTorchMemoryVizStatsAgree) {
  if (std::system("/usr/bin/python3 -c 'import torch.cuda._memory_viz' >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "no python3-torch for /usr/bin/python3";
  }
  MlpRun run;
  const Timeline timeline = Timeline::Replay(run.session.recorder());
  const std::string dir = ::testing::TempDir() + "/memsim_memory_viz_test";
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/snapshot.pickle";
  ASSERT_TRUE(WriteSnapshot(path, run.session.recorder(), timeline.peak_event(), {}).ok());
  const std::string command =
      "/usr/bin/python3 -c \"import pickle; from torch.cuda import _memory_viz as mv; "
      "s = mv.stats(pickle.load(open('" +
      path +
      "', 'rb'))['segments']); "
      "print(s['total_size'].value, s['active_allocated'].value)\"";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  long long total = 0, active = 0;
  const int read = fscanf(pipe, "%lld %lld", &total, &active);
  ASSERT_EQ(pclose(pipe), 0);
  ASSERT_EQ(read, 2);
  EXPECT_EQ(total, 2 * kMiB);  // one small-pool segment
  EXPECT_EQ(active, timeline.peak_allocated_bytes());
}

}  // namespace
}  // namespace memsim
