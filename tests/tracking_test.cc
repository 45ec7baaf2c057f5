// The tracking allocator and interceptor: exact allocation/free sequences, attribution of
// forward and backward allocations, and user-facing errors for missing kernels.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "simulator/allocator_replay.h"
#include "simulator/session.h"
#include "simulator/status.h"
#include "simulator/timeline.h"
#include "simulator/tracking_allocator.h"
#include "tests/support/test_mlp.h"

namespace memsim {
namespace {

// (is_alloc, storage id, bytes) for every event.
using EventTuple = std::tuple<bool, int64_t, int64_t>;
std::vector<EventTuple> Events(const Recorder& r) {
  std::vector<EventTuple> out;
  for (const MemoryEvent& e : r.events()) {
    out.emplace_back(e.is_alloc, e.storage_id, r.storages()[e.storage_id].size_bytes);
  }
  return out;
}

at::TensorOptions MetaFloat() { return at::TensorOptions().device(at::kMeta).dtype(at::kFloat); }

TEST(Tracking, ViewsAllocateNothingAndFreesFollowLastReference) {
  Session session;
  {
    ActiveSession active(session);
    at::Tensor a = at::empty({4, 8}, MetaFloat());  // 4*8*4 = 128 B
    at::Tensor b = a.view({32});                    // view: shares a's storage
    at::Tensor c = a + 1;                           // 128 B
    at::Tensor d = at::empty({0}, MetaFloat());     // zero bytes: not tracked, like CUDA
    a.reset();                                      // b still holds storage 0
  }
  // Scope exit destroys d, c (storage 1), then b (last reference to storage 0).
  const std::vector<EventTuple> expected = {
      {true, 0, 128}, {true, 1, 128}, {false, 1, 128}, {false, 0, 128}};
  EXPECT_EQ(Events(session.recorder()), expected);
  const Recorder& r = session.recorder();
  // The op the model called; the add.Tensor it decomposes into belongs to it.
  EXPECT_EQ(r.names().Name(r.storages()[1].op), "aten::add.Scalar");
  EXPECT_EQ(r.storages()[1].ndim, 2);
  EXPECT_EQ(r.ShapeOf(r.storages()[1]), c10::IntArrayRef({4, 8}));
  EXPECT_EQ(r.storages()[1].dtype, at::kFloat);
  EXPECT_EQ(r.peak_live_bytes(), 256);
}

TEST(Tracking, SavedTensorsAndBackwardAllocationsAreAttributed) {
  Session session;
  {
    ActiveSession active(session);
    session.SetPhase(Phase::kForward);
    at::Tensor x = at::empty({2, 3}, MetaFloat()).requires_grad_();  // id 0: 2*3*4 = 24 B
    at::Tensor y;
    at::Tensor z;
    {
      ModuleScope scope("expmod");
      y = x.exp();  // id 1: 24 B, saved by ExpBackward (it needs its result)
    }
    {
      ModuleScope scope("summod");
      z = y.sum();  // id 2: 4 B scalar
    }
    session.SetPhase(Phase::kBackward);
    // Backward: the engine seeds ones_like(z) (id 3, 4 B); SumBackward expands it (a
    // view); ExpBackward computes grad * result (id 4, 24 B), after which the expanded
    // seed dies (free 3); AccumulateGrad steals id 4 as x.grad.
    z.backward();
  }
  // Scope exit: z (2), y (1), then x: its grad (4) before its own storage (0).
  const std::vector<EventTuple> expected = {
      {true, 0, 24}, {true, 1, 24}, {true, 2, 4},   {true, 3, 4},   {true, 4, 24},
      {false, 3, 4}, {false, 2, 4}, {false, 1, 24}, {false, 4, 24}, {false, 0, 24}};
  EXPECT_EQ(Events(session.recorder()), expected);

  const Recorder& r = session.recorder();
  EXPECT_EQ(r.names().Name(r.storages()[1].module), "expmod");
  EXPECT_EQ(r.names().Name(r.storages()[2].module), "summod");
  // The gradient is made in backward by ExpBackward, whose node expmod's forward created.
  EXPECT_EQ(r.storages()[4].phase, Phase::kBackward);
  EXPECT_EQ(r.names().Name(r.storages()[4].module), "expmod");
  EXPECT_EQ(r.names().Name(r.storages()[4].op), "aten::mul.Tensor");
  EXPECT_EQ(r.storages()[1].category, Category::kActivation);
  EXPECT_EQ(r.storages()[4].category, Category::kTemporary);
}

TEST(Tracking, NestedModulePathsAndCategoryScopes) {
  Session session;
  ActiveSession active(session);
  at::Tensor w;
  {
    ModuleScope outer("layers.0");
    ModuleScope inner("attn");
    CategoryScope category(Category::kParameter);
    w = at::empty({8}, MetaFloat());
  }
  const Recorder& r = session.recorder();
  EXPECT_EQ(r.names().Name(r.storages()[0].module), "layers.0.attn");
  EXPECT_EQ(r.storages()[0].category, Category::kParameter);
  EXPECT_EQ(r.current_module(), 0);
}

TEST(Tracking, MissingMetaKernelNamesOpAndModule) {
  Session session;
  ActiveSession active(session);
  session.SetPhase(Phase::kForward);
  at::Tensor t = at::empty({4}, MetaFloat());
  ModuleScope scope("decoder");
  try {
    (void)at::flip(t, {0});  // aten::flip has no Meta kernel in LibTorch 1.13
    FAIL() << "expected a UserError";
  } catch (const UserError& e) {
    EXPECT_EQ(std::string(e.what()),
              "aten::flip has no Meta kernel (called from module 'decoder' in forward); add one "
              "in ops/meta_kernels.cc");
  }
}

// ops/meta_kernels.cc's roll allocates as roll_cuda does: one contiguous output, after a
// contiguous copy of a non-contiguous input.
TEST(Tracking, RollAllocatesLikeTheCudaKernel) {
  Session session;
  {
    ActiveSession active(session);
    at::Tensor t = at::empty({4, 8}, MetaFloat());  // id 0: 128 B
    at::Tensor rolled = at::roll(t, {-1}, {-1});    // id 1: 128 B
    EXPECT_EQ(rolled.sizes(), t.sizes());
    EXPECT_TRUE(rolled.is_contiguous());
    at::Tensor from_transposed = at::roll(t.t(), {1}, {0});  // ids 2 (copy, freed), 3
    EXPECT_EQ(from_transposed.sizes(), c10::IntArrayRef({8, 4}));
  }
  const std::vector<EventTuple> expected = {{true, 0, 128},  {true, 1, 128},  {true, 2, 128},
                                            {true, 3, 128},  {false, 2, 128}, {false, 3, 128},
                                            {false, 1, 128}, {false, 0, 128}};
  EXPECT_EQ(Events(session.recorder()), expected);
}

TEST(Tracking, AllocationsWithoutSessionAreNotTracked) {
  Session session;
  at::Tensor outside = at::empty({16}, MetaFloat());
  {
    ActiveSession active(session);
    outside.reset();  // allocated before the session: its free is not seen either
  }
  EXPECT_TRUE(session.recorder().events().empty());
}

TEST(Tracking, RecorderMayDieBeforeItsTensors) {
  at::Tensor survivor;
  {
    Session session;
    ActiveSession active(session);
    survivor = at::empty({16}, MetaFloat());
  }
  survivor.reset();  // must not touch the destroyed recorder
  SUCCEED();
}

TEST(Tracking, MetaResizeGrowsThroughTheTracker) {
  Session session;
  {
    ActiveSession active(session);
    at::Tensor t = at::empty({2}, MetaFloat());  // 8 B
    t.resize_({1});                              // shrinking keeps the storage
    t.resize_({16});                             // growing: new 64 B storage, old one freed
    EXPECT_EQ(t.sizes(), c10::IntArrayRef({16}));
  }
  const std::vector<EventTuple> expected = {
      {true, 0, 8}, {true, 1, 64}, {false, 0, 8}, {false, 1, 64}};
  EXPECT_EQ(Events(session.recorder()), expected);
}

// Offloading's accounting (Note [Fine-grained activation offloading] in
// models/activation_offload.h): an evicted storage's free is recorded at once and its
// tensors' own free records nothing; a restored one is a new storage allocated then and
// attributed like the original, freed where its tensors die; one whose tensors died while
// evicted has nothing to restore.
TEST(Tracking, EvictedStoragesFreeAtOnceAndComeBackAsNewStorages) {
  Session session;
  int64_t restored = -1;
  {
    ActiveSession active(session);
    Recorder& r = session.recorder();
    at::Tensor a = at::empty({4, 8}, MetaFloat());  // id 0: 128 B
    at::Tensor b = at::empty({2}, MetaFloat());     // id 1: 8 B
    r.Evict(0);
    r.Evict(1);
    EXPECT_EQ(r.live_bytes(), 0);
    b.reset();  // died while evicted: no event
    EXPECT_EQ(r.Restore(1), -1);
    restored = r.Restore(0);      // id 2: 128 B
    EXPECT_EQ(r.Restore(0), -1);  // restored already
    EXPECT_EQ(r.live_bytes(), 128);
    at::Tensor c = a + 1;  // a is still a usable meta tensor; c is id 3
  }                        // c dies, then a: its free is the restored storage's
  const std::vector<EventTuple> expected = {{true, 0, 128},  {true, 1, 8},   {false, 0, 128},
                                            {false, 1, 8},   {true, 2, 128}, {true, 3, 128},
                                            {false, 3, 128}, {false, 2, 128}};
  EXPECT_EQ(Events(session.recorder()), expected);
  EXPECT_EQ(restored, 2);
  const Recorder& r = session.recorder();
  EXPECT_EQ(r.names().Name(r.storages()[2].op), "aten::empty.memory_format");
  EXPECT_EQ(r.ShapeOf(r.storages()[2]), c10::IntArrayRef({4, 8}));
}

// Note [CUDA graphs]: what the recorder counts in each graph mode. A graphed scope's
// forward (sin) and its backward node (cos and mul) count while capturing and not in
// replays; the eager rest (the input, sum and the engine's seed gradient) the other way
// round; state the driving code names (a workspace) counts in every mode, made outside
// graphed scopes while capturing from the capture's end (Note [State made during the
// capture]).
// Note [Packed storages]: replicas share their template's kind, renamed ones a renamed kind;
// changing one storage's category must change no other storage's.
TEST(Tracking, ReplicasShareWhatTheirTemplateIsUntilOneIsRetagged) {
  Session session;
  Recorder& r = session.recorder();
  {
    ActiveSession active(session);
    r.PushChildModule("layers.0");
    at::empty({256}, MetaFloat());  // storage 0: events 0 (alloc) and 1 (free)
    r.PopModule();
  }
  ASSERT_EQ(r.events().size(), 2u);
  const Category made_as = r.storages()[0].category;
  ASSERT_NE(made_as, Category::kGradient);
  Recorder::IdShift ids;
  ASSERT_TRUE(r.AppendReplica(0, 2, 0.0, {}, &ids));  // storage 1, as made
  Recorder::ReplicaOuter renamed;
  renamed.renames = {{"layers.0", "layers.5"}};
  ASSERT_TRUE(r.AppendReplica(0, 2, 0.0, renamed, &ids));  // storages 2 and 3: layers.5
  ASSERT_TRUE(r.AppendReplica(0, 2, 0.0, renamed, &ids));
  r.Retag(1, Category::kGradient);
  r.Retag(2, Category::kOptimizerState);

  ASSERT_EQ(r.storages().size(), 4u);
  const Category categories[] = {made_as, Category::kGradient, Category::kOptimizerState, made_as};
  const char* modules[] = {"layers.0", "layers.0", "layers.5", "layers.5"};
  for (size_t id = 0; id < 4; ++id) {
    const StorageInfo s = r.storages()[id];
    EXPECT_EQ(s.category, categories[id]) << "storage " << id;
    EXPECT_EQ(r.names().Name(s.module), modules[id]) << "storage " << id;
    EXPECT_EQ(s.size_bytes, 1024) << "storage " << id;
    EXPECT_EQ(s.alloc_event, static_cast<int64_t>(2 * id)) << "storage " << id;
    EXPECT_EQ(s.free_event, static_cast<int64_t>(2 * id + 1)) << "storage " << id;
    EXPECT_EQ(r.ShapeOf(s), c10::IntArrayRef({256})) << "storage " << id;
  }
}

// Note [Packed storages]: a storage's iteration is read off where iterations began, not
// kept with it; it must be the iteration current when the storage was allocated.
TEST(Tracking, AStoragesIterationIsTheOneCurrentAtItsAllocation) {
  Session session;
  {
    ActiveSession active(session);
    at::Tensor setup = at::empty({4}, MetaFloat());  // storage 0: before any iteration
    session.BeginIteration(0);
    at::Tensor first = at::empty({4}, MetaFloat());  // 1
    session.EndIteration();
    at::Tensor between = at::empty({4}, MetaFloat());  // 2: iteration 0 has not been left
    session.BeginIteration(3);
    session.BeginIteration(5);                       // no event between: 5 holds
    at::Tensor later = at::empty({4}, MetaFloat());  // 3
  }
  const Recorder& r = session.recorder();
  ASSERT_EQ(r.storages().size(), 4u);
  const int32_t iterations[] = {-1, 0, 0, 5};
  for (size_t id = 0; id < 4; ++id) {
    EXPECT_EQ(r.storages()[id].iteration, iterations[id]) << "storage " << id;
  }
}

// EndRecording closes the log and drops its table of live records: a tensor that outlives
// the recording frees unrecorded, as after the recorder's death.
TEST(Tracking, TensorsOutlivingTheRecordingFreeUnrecorded) {
  Session session;
  at::Tensor kept;
  {
    ActiveSession active(session);
    kept = at::empty({4}, MetaFloat());  // event 0
    at::empty({8}, MetaFloat());         // events 1 and 2
  }
  session.recorder().EndRecording();
  kept.reset();
  EXPECT_EQ(session.recorder().events().size(), 3u);
  EXPECT_EQ(session.recorder().storages()[0].free_event, -1);
}

TEST(Tracking, GraphModesCountGraphedScopesOnlyWhileCapturing) {
  auto ops_recorded = [](Recorder::GraphMode mode) {
    Session session;
    {
      ActiveSession active(session);
      session.recorder().set_graph_mode(mode);
      at::Tensor x = at::empty({4}, MetaFloat()).requires_grad_();
      at::Tensor y;
      {
        GraphedScope graphed(true);
        y = at::sin(x);
      }
      at::Tensor workspace;
      {
        CategoryScope category(Category::kWorkspace);
        workspace = at::empty({8}, MetaFloat());
      }
      y.sum().backward();
      session.recorder().set_graph_mode(Recorder::GraphMode::kEager);
    }
    std::set<std::string> ops;
    const Recorder& r = session.recorder();
    for (const StorageInfo& storage : r.storages()) ops.insert(r.names().Name(storage.op));
    return ops;
  };
  const std::set<std::string> graphed = {"aten::sin", "aten::cos", "aten::mul.Tensor"};
  const std::set<std::string> eager = ops_recorded(Recorder::GraphMode::kEager);
  const std::set<std::string> capture = ops_recorded(Recorder::GraphMode::kCapture);
  const std::set<std::string> replay = ops_recorded(Recorder::GraphMode::kReplay);
  for (const std::string& op : graphed) {
    EXPECT_EQ(eager.count(op), 1u) << op;
    EXPECT_EQ(capture.count(op), 1u) << op;
    EXPECT_EQ(replay.count(op), 0u) << op;
  }
  for (const char* op : {"aten::sum", "aten::ones_like"}) {
    EXPECT_EQ(eager.count(op), 1u) << op;
    EXPECT_EQ(capture.count(op), 0u) << op;
    EXPECT_EQ(replay.count(op), 1u) << op;
  }
  // The input and the workspace are both aten::empty: the workspace counts in each mode.
  EXPECT_EQ(capture.count("aten::empty.memory_format"), 1u);
  EXPECT_EQ(replay.count("aten::empty.memory_format"), 1u);
}

// Note [State made during the capture]: while capturing, state made outside graphed scopes
// (a 64-byte workspace kept, a 32-byte one dropped) is recorded only when the capture ends,
// after everything the capture recorded (a graphed 16-byte activation), with its module and
// category; the dropped one never is. State made in a graphed scope counts at once.
TEST(Tracking, CaptureDefersStateMadeOutsideGraphs) {
  Session session;
  ActiveSession active(session);
  Recorder& r = session.recorder();
  r.set_graph_mode(Recorder::GraphMode::kCapture);
  const auto workspace = [](int64_t floats) {
    CategoryScope category(Category::kWorkspace);
    ModuleScope scope(ModuleScope::Absolute{"grouped_gemm_workspace"});
    return at::empty({floats}, MetaFloat());
  };
  const at::Tensor kept = workspace(16);
  workspace(8);  // made and dropped during the capture
  at::Tensor graphed_workspace, activation;
  {
    GraphedScope graphed(true);
    graphed_workspace = workspace(2);
    activation = at::empty({4}, MetaFloat());
  }
  EXPECT_EQ(Events(r), (std::vector<EventTuple>{{true, 0, 8}, {true, 1, 16}}));
  r.set_graph_mode(Recorder::GraphMode::kReplay);
  EXPECT_EQ(Events(r), (std::vector<EventTuple>{{true, 0, 8}, {true, 1, 16}, {true, 2, 64}}));
  const StorageInfo& deferred = r.storages()[2];
  EXPECT_EQ(r.names().Name(deferred.module), "grouped_gemm_workspace");
  EXPECT_EQ(deferred.category, Category::kWorkspace);
}

// An empty_cache() marker (Session::EmptyCache) releases the cached segments no block uses
// when the log is replayed (Note [Allocator replay]): a 30 MiB tensor gets a 30 MiB segment
// of its own; freed and cached, it would hold the next 4 MiB tensor, but emptied, that one
// needs a fresh 20 MiB segment (requests under 10 MiB get kLargeBuffer). Allocated memory
// is the same either way.
TEST(AllocatorReplay, EmptyCacheMarkerReleasesFreeSegments) {
  for (bool empty_cache : {false, true}) {
    Session session;
    {
      ActiveSession active(session);
      at::Tensor big = at::empty({30 << 20}, MetaFloat().dtype(at::kByte));
      big.reset();
      if (empty_cache) session.EmptyCache();
      at::Tensor small = at::empty({4 << 20}, MetaFloat().dtype(at::kByte));
      small.reset();
      if (empty_cache) session.EmptyCache();  // after the last event: applied at the end
    }
    CachingAllocatorModel allocator;
    struct Reserved : ReplayVisitor {
      CachingAllocatorModel* allocator;
      std::vector<int64_t> after_alloc;
      void OnAlloc(int64_t, const MemoryEvent&, const CachingAllocatorModel::Allocation&) {
        after_alloc.push_back(allocator->stats().reserved_bytes);
      }
    } reserved;
    reserved.allocator = &allocator;
    const Recorder& r = session.recorder();
    EXPECT_EQ(ReplayAllocations(r, &allocator, static_cast<int64_t>(r.events().size()), reserved),
              -1);
    const std::vector<int64_t> expected = empty_cache ? std::vector<int64_t>{30 << 20, 20 << 20}
                                                      : std::vector<int64_t>{30 << 20, 30 << 20};
    EXPECT_EQ(reserved.after_alloc, expected) << "empty_cache " << empty_cache;
    EXPECT_EQ(allocator.stats().reserved_bytes, empty_cache ? 0 : 30 << 20);
    EXPECT_EQ(allocator.stats().allocated_bytes, 0);
    EXPECT_EQ(allocator.stats().peak_allocated_bytes, 30 << 20);
  }
}

// The allocator settings a recording carries (PYTORCH_CUDA_ALLOC_CONF) reach every replay.
// A 30 MiB block is freed, then 10 MiB and 25 MiB are requested. By default the 10 MiB
// take the front of the cached 30 MiB segment and the 25 MiB need a new 26 MiB one: 56 MiB
// reserved. With max_split_size_mb:21 (Note [Oversize blocks]) the 30 MiB block is
// oversize: the 10 MiB get a segment of their own, and the 25 MiB (an oversize request
// wasting under 20 MiB) take the whole 30 MiB block: 40 MiB. On a device of 39 MiB the
// default runs out of memory (30 + 26, nothing cached to release), while with the setting
// the cached 30 MiB segment is released for the 10 MiB one and 10 + 26 fits.
TEST(AllocatorReplay, RecordedAllocatorSettingsApplyToTheTimelineAndCapacityReplays) {
  for (int64_t max_split_bytes : {int64_t{0}, int64_t{21} << 20}) {
    Session session;
    CachingAllocatorConfig settings;
    settings.max_split_size_bytes = max_split_bytes;
    session.recorder().SetAllocatorSettings(settings);
    {
      ActiveSession active(session);
      at::Tensor big = at::empty({30 << 20}, MetaFloat().dtype(at::kByte));
      big.reset();
      at::Tensor medium = at::empty({10 << 20}, MetaFloat().dtype(at::kByte));
      at::Tensor large = at::empty({25 << 20}, MetaFloat().dtype(at::kByte));
    }
    const int64_t expected = max_split_bytes == 0 ? 56 << 20 : 40 << 20;
    EXPECT_EQ(Timeline::Replay(session.recorder()).peak_reserved_bytes(), expected);
    EXPECT_EQ(ReplayWithCapacity(session.recorder(), 39 << 20).fits(), max_split_bytes != 0);
  }
}

// Fake execution sees what real execution does: the same fp32 model, run on meta and on
// real CPU tensors through the tracking CPU allocator, allocates and frees the same sizes
// in the same order.
TEST(Tracking, MetaRunMatchesRealCpuRun) {
  InstallCpuTrackingAllocator();
  TestMlpConfig config;
  config.iterations = 2;

  Session meta_session;
  at::Tensor meta_loss;  // held like cpu_loss, so both runs see the same frees
  {
    ActiveSession active(meta_session);
    config.device = at::kMeta;
    meta_loss = RunTestMlpTraining(config, &meta_session);
  }
  Session cpu_session(nullptr, c10::DeviceType::CPU);
  at::Tensor cpu_loss;
  {
    ActiveSession active(cpu_session);
    config.device = at::kCPU;
    cpu_loss = RunTestMlpTraining(config, &cpu_session);
  }
  ASSERT_GT(meta_session.recorder().events().size(), 40u);
  std::vector<std::pair<bool, int64_t>> meta_sizes;
  std::vector<std::pair<bool, int64_t>> cpu_sizes;
  for (const auto& [is_alloc, id, bytes] : Events(meta_session.recorder())) {
    meta_sizes.emplace_back(is_alloc, bytes);
  }
  for (const auto& [is_alloc, id, bytes] : Events(cpu_session.recorder())) {
    cpu_sizes.emplace_back(is_alloc, bytes);
  }
  EXPECT_EQ(meta_sizes, cpu_sizes);
  EXPECT_EQ(meta_session.recorder().peak_live_bytes(), cpu_session.recorder().peak_live_bytes());
  EXPECT_TRUE(std::isfinite(cpu_loss.item<float>()));
}

}  // namespace
}  // namespace memsim
