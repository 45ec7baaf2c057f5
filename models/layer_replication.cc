#include "models/layer_replication.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "simulator/check.h"
#include "simulator/recorder.h"
#include "simulator/status.h"
#include "simulator/tracking_allocator.h"

namespace memsim {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A span of the event log and of the virtual clock.
struct Span {
  int64_t begin_event = 0, end_event = 0;
  double begin_s = 0, end_s = 0;
  double duration_s() const { return end_s - begin_s; }
};

Span Begin(const Recorder& r) { return {static_cast<int64_t>(r.events().size()), 0, r.now_s(), 0}; }
void End(const Recorder& r, Span* span) {
  span->end_event = static_cast<int64_t>(r.events().size());
  span->end_s = r.now_s();
}

[[noreturn]] void Bug(const std::string& what) {
  throw UserError("memsim bug (Note [Layer replication]): " + what);
}

// One unit of the gap: its copied forward.
struct GapLayer {
  std::vector<std::string> paths;  // its layers' module paths
  int64_t input_id;                // storage of its input (the previous unit's output)
  int64_t output_id;               // storage of its output
  int64_t first_id;                // first storage its forward allocated (T's first, shifted)
};

// What the bridge needs in backward; U's backward is filled in by hooks as it runs.
struct GapState : public torch::CustomClassHolder {
  Recorder* recorder = nullptr;
  std::vector<GapLayer> gap;
  Recorder::IdShift u_forward;  // the storages U's forward allocated (shift unused)
  std::vector<std::string> u_paths;
  int64_t u_input_id = -1;
  Span u_backward;
  int64_t u_grad_out_id = -1;  // gradient of U's output: freed in U's backward
  int64_t u_grad_in_id = -1;   // gradient of U's input: allocated in U's backward
};

// Renames from a template unit's layers to a copy's, layer by layer.
std::vector<std::pair<std::string, std::string>> Renames(const std::vector<std::string>& from,
                                                         const std::vector<std::string>& to) {
  std::vector<std::pair<std::string, std::string>> renames;
  for (size_t k = 0; k < from.size() && k < to.size(); ++k) renames.emplace_back(from[k], to[k]);
  return renames;
}

// Copies `span` for one unit; returns the copy's storage shift.
Recorder::IdShift Copy(Recorder& r, const Span& span, Recorder::ReplicaOuter outer) {
  Recorder::IdShift ids;
  if (!r.AppendReplica(span.begin_event, span.end_event, r.now_s() - span.begin_s, outer, &ids)) {
    Bug("a copied layer frees a storage it cannot map, from " + outer.renames[0].first);
  }
  r.AdvanceClock(span.duration_s());
  return ids;
}

// A tensor like `like` standing for copied storage `id`.
at::Tensor AdoptLike(Recorder& r, int64_t id, const at::Tensor& like) {
  r.AdoptNextAllocation(id);
  return at::empty(like.sizes(), like.options());
}

// A byte tensor standing for copied storage `id` (a layer's kept state, never read).
at::Tensor AdoptBytes(Recorder& r, int64_t id) {
  r.AdoptNextAllocation(id);
  return at::empty({r.storages()[static_cast<size_t>(id)].size_bytes},
                   at::TensorOptions().device(at::kMeta).dtype(at::kByte));
}

struct GapBridge : public torch::autograd::Function<GapBridge> {
  // `before_gap` is T's output, saved because the gap's first layer would hold it until
  // its backward; returns U's input.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& before_gap,
                            c10::intrusive_ptr<GapState> state) {
    ctx->save_for_backward({before_gap});
    at::Tensor after_gap = AdoptLike(*state->recorder, state->gap.back().output_id, before_gap);
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return after_gap;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto state =
        c10::static_intrusive_pointer_cast<GapState>(ctx->saved_data["state"].toCapsule());
    Recorder& r = *state->recorder;
    if (state->u_backward.end_event <= state->u_backward.begin_event ||
        TrackingAllocator::StorageIdOf(grads[0], r) != state->u_grad_in_id) {
      Bug("the backward of " + state->u_paths[0] + " was not seen whole");
    }
    int64_t grad_id = state->u_grad_in_id;
    for (auto g = state->gap.rbegin(); g != state->gap.rend(); ++g) {
      Recorder::ReplicaOuter outer;
      outer.shift = {state->u_forward.first, state->u_forward.last,
                     g->first_id - state->u_forward.first};
      outer.ids = {{state->u_input_id, g->input_id}, {state->u_grad_out_id, grad_id}};
      outer.renames = Renames(state->u_paths, g->paths);
      const Recorder::IdShift ids = Copy(r, state->u_backward, outer);
      if (!ids.Maps(state->u_grad_in_id)) Bug(state->u_paths[0] + "'s input gradient");
      grad_id = state->u_grad_in_id + ids.shift;
    }
    return {AdoptLike(r, grad_id, grads[0]), at::Tensor()};
  }
};

// Whether U's forward recorded what T's did: the same allocations and frees in the same
// order, each free of the same storage relative to the layer (its own, counted from
// `t_first` and `u_first`, or one of the `outer` pairs: input, previous state).
bool SameForward(const Recorder& r, const Span& t, const Span& u, int64_t t_first, int64_t u_first,
                 const std::vector<std::pair<int64_t, int64_t>>& outer) {
  if (t.end_event - t.begin_event != u.end_event - u.begin_event) return false;
  for (int64_t k = 0; k < t.end_event - t.begin_event; ++k) {
    const MemoryEvent& a = r.events()[static_cast<size_t>(t.begin_event + k)];
    const MemoryEvent& b = r.events()[static_cast<size_t>(u.begin_event + k)];
    const StorageInfo& sa = r.storages()[static_cast<size_t>(a.storage_id)];
    const StorageInfo& sb = r.storages()[static_cast<size_t>(b.storage_id)];
    if (a.is_alloc != b.is_alloc || sa.size_bytes != sb.size_bytes) return false;
    bool same = a.storage_id - t_first == b.storage_id - u_first;
    for (const auto& [t_id, u_id] : outer) {
      if (a.storage_id == t_id) same = b.storage_id == u_id;
    }
    if (!same) return false;
  }
  return true;
}

// Whether `ids` maps every kept storage of `state` (-1: an empty slot).
bool AllMapped(const Recorder::IdShift& ids, const std::vector<int64_t>& state) {
  for (int64_t id : state) {
    if (id >= 0 && !ids.Maps(id)) return false;
  }
  return true;
}

// What T's forward may free that it did not allocate, paired with a unit's own: T's
// input and the state T's previous forward kept (-1: an empty slot, nothing to free).
std::vector<std::pair<int64_t, int64_t>> OuterIds(int64_t t_input, int64_t input,
                                                  const std::vector<int64_t>& t_old_state,
                                                  const std::vector<int64_t>& old_state) {
  std::vector<std::pair<int64_t, int64_t>> ids = {{t_input, input}};
  for (size_t k = 0; k < t_old_state.size(); ++k) {
    if (t_old_state[k] >= 0) ids.emplace_back(t_old_state[k], old_state[k]);
  }
  return ids;
}

// The first storage allocated in `span`, or -1.
int64_t FirstAllocated(const Recorder& r, const Span& span) {
  for (int64_t e = span.begin_event; e < span.end_event; ++e) {
    const MemoryEvent& event = r.events()[static_cast<size_t>(e)];
    if (event.is_alloc) return event.storage_id;
  }
  return -1;
}

}  // namespace

at::Tensor RunReplicatedUnits(int64_t first, int64_t last, const at::Tensor& hidden,
                              const UnitRunner& units) {
  Recorder* recorder = CurrentRecorder();
  at::Tensor h = hidden;
  if (recorder == nullptr || last - first < kMinReplicatedUnits) {
    for (int64_t i = first; i < last; ++i) h = units.run(i, h);
    return h;
  }
  Recorder& r = *recorder;
  // The storages unit i keeps in its state slots (-1: empty).
  auto state_ids = [&](int64_t i) {
    std::vector<int64_t> ids;
    for (const at::Tensor* slot : units.state(i))
      ids.push_back(TrackingAllocator::StorageIdOf(*slot, r));
    return ids;
  };
  const int64_t t_unit = first + 1, u_unit = last - 2;
  h = units.run(first, h);

  // T: the forward template.
  const int64_t t_input = TrackingAllocator::StorageIdOf(h, r);
  const std::vector<int64_t> t_old_state = state_ids(t_unit);
  Span t = Begin(r);
  h = units.run(t_unit, h);
  End(r, &t);
  const int64_t t_output = TrackingAllocator::StorageIdOf(h, r);
  const std::vector<int64_t> t_state = state_ids(t_unit);
  // T's own forward storages: ids are handed out in event order.
  const int64_t t_end_id = static_cast<int64_t>(r.storages().size());
  const int64_t t_first_id = FirstAllocated(r, t);
  const Recorder::IdShift t_forward = {t_first_id < 0 ? t_end_id : t_first_id, t_end_id, 0};
  // Its output or kept state is not its own (a view of something older), or it frees its
  // input in forward (nothing keeps it for backward: an fp32 residual stream, whose norms
  // keep 16-bit copies, Note [FP32 residual stream] in transformer.h), which the copies and
  // the bridge do not model: run them all.
  if (t_input < 0 || r.storages().life(static_cast<size_t>(t_input)).free_event >= 0 ||
      !t_forward.Maps(t_output) || !AllMapped(t_forward, t_state)) {
    for (int64_t i = t_unit + 1; i < last; ++i) h = units.run(i, h);
    return h;
  }

  // The gap: copies of T's forward.
  auto gap = c10::make_intrusive<GapState>();
  gap->recorder = &r;
  int64_t input = t_output;
  for (int64_t g = t_unit + 1; g < u_unit; ++g) {
    Recorder::ReplicaOuter outer;
    outer.ids = OuterIds(t_input, input, t_old_state, state_ids(g));
    outer.renames = Renames(units.module_paths(t_unit), units.module_paths(g));
    Recorder::IdShift ids;
    if (!r.AppendReplica(t.begin_event, t.end_event, r.now_s() - t.begin_s, outer, &ids)) {
      // T frees a storage no copy can name (nothing was appended): run them all.
      if (g != t_unit + 1) Bug(outer.renames[0].second + "'s forward could not be copied");
      for (int64_t i = g; i < last; ++i) h = units.run(i, h);
      return h;
    }
    r.AdvanceClock(t.duration_s());
    const std::vector<at::Tensor*> slots = units.state(g);
    for (size_t k = 0; k < slots.size(); ++k) {
      if (t_state[k] < 0) continue;
      // Slots that share a storage share the tensor that stands for it.
      const size_t same = std::find(t_state.begin(), t_state.end(), t_state[k]) - t_state.begin();
      *slots[k] = same < k ? *slots[same] : AdoptBytes(r, t_state[k] + ids.shift);
    }
    gap->gap.push_back({units.module_paths(g), input, t_output + ids.shift, ids.first + ids.shift});
    input = t_output + ids.shift;
  }

  // U: the backward template, behind the bridge; hooks find its backward's span.
  at::Tensor u_input = GapBridge::apply(h, gap);
  h.reset();
  gap->u_paths = units.module_paths(u_unit);
  gap->u_input_id = input;
  GapState* s = gap.get();  // the bridge node keeps it alive through backward
  u_input.register_hook([s](const at::Tensor& grad) {
    End(*s->recorder, &s->u_backward);
    s->u_grad_in_id = TrackingAllocator::StorageIdOf(grad, *s->recorder);
  });
  const std::vector<int64_t> u_old_state = state_ids(u_unit);
  Span u = Begin(r);
  h = units.run(u_unit, u_input);
  End(r, &u);
  u_input.reset();
  const int64_t u_first = FirstAllocated(r, u);
  gap->u_forward = {u_first, u_first + (t_forward.last - t_forward.first), 0};
  if (!SameForward(r, t, u, t_forward.first, u_first,
                   OuterIds(t_input, input, t_old_state, u_old_state)) ||
      TrackingAllocator::StorageIdOf(h, r) - u_first != t_output - t_forward.first) {
    Bug(gap->u_paths[0] + "'s forward differs from " + units.module_paths(t_unit)[0] + "'s");
  }
  h.register_hook([s](const at::Tensor& grad) {
    s->u_backward = Begin(*s->recorder);
    s->u_grad_out_id = TrackingAllocator::StorageIdOf(grad, *s->recorder);
  });
  return units.run(last - 1, h);
}

}  // namespace memsim
