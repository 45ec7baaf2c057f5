// What every recorded allocation is attributed to: phase and memory category.
#pragma once

#include <cstdint>
#include <string_view>

#include "simulator/enum_names.h"

namespace memsim {

// The part of a training iteration that is running. Setup covers everything before the
// first iteration (parameters, optimizer state allocated eagerly, buffers).
enum class Phase : uint8_t { kSetup, kForward, kBackward, kOptimizer };
inline constexpr int kNumPhases = 4;
inline constexpr EnumName<Phase> kPhaseNames[] = {{Phase::kSetup, "setup"},
                                                  {Phase::kForward, "forward"},
                                                  {Phase::kBackward, "backward"},
                                                  {Phase::kOptimizer, "optimizer"}};

// Why a storage exists; the run summary breaks the peak down by these.
//
// Note [Memory categories]
// A storage's category is decided when it is allocated, in this order:
//   1. an explicit CategoryScope set by the driving code (parameters, gradient buffers,
//      optimizer state) or a later Session::Retag (a storage recategorized after the fact);
//   2. allocations made inside a collective (OpTraits::is_collective) are kCommunication;
//   3. otherwise by phase: forward allocations are kActivation (held for backward or
//      freed as soon as they die, in which case they never reach a peak's breakdown for
//      long), everything else is kTemporary.
enum class Category : uint8_t {
  kUnattributed,  // no scope applies; rule 3 decides at allocation time
  kParameter,
  kGradient,
  kOptimizerState,
  kActivation,
  kTemporary,
  kCommunication,
  kWorkspace,  // CUDA libraries' scratch memory (Note [Library workspaces])
};
inline constexpr int kNumCategories = 8;
// As summaries and snapshots name them (Note [Enum names]).
inline constexpr EnumName<Category> kCategoryNames[] = {
    {Category::kUnattributed, "unattributed"},   {Category::kParameter, "parameters"},
    {Category::kGradient, "gradients"},          {Category::kOptimizerState, "optimizer_state"},
    {Category::kActivation, "activations"},      {Category::kTemporary, "temporaries"},
    {Category::kCommunication, "communication"}, {Category::kWorkspace, "workspaces"}};

inline std::string_view PhaseName(Phase phase) { return NameOf(kPhaseNames, phase); }
inline std::string_view CategoryName(Category category) { return NameOf(kCategoryNames, category); }

}  // namespace memsim
