// OpTraits: how the interceptor treats an operator that is not ATen's own (the memsim::
// operators ops/ defines). The layer that defines an operator registers its traits when
// it registers the operator, so the interceptor (below ops/ in the layering) never
// matches operator names of layers above it.
#pragma once

#include <string>

#include "simulator/cost_model.h"

namespace memsim {

struct OpTraits {
  OpCostKind cost_kind = OpCostKind::kMemoryBound;
  // A fake collective: what it allocates is a communication buffer (Note [Memory
  // categories] in attribution.h).
  bool is_collective = false;
  // Fused attention over q [B, S, heads, D], costed from q's shape (Note [Virtual
  // clock]); q is argument 0 of the forward and argument 1 of the backward.
  bool is_attention = false;
  bool is_attention_backward = false;
};

// Registers the traits of operator `name` (the schema name without overload, such as
// "memsim::comm_all_gather"). Registering a name again replaces its traits. Thread-safe.
void RegisterOpTraits(const std::string& name, const OpTraits& traits);

// The traits registered for `name`, or null when none were. Thread-safe; the returned
// traits stay valid until `name` is registered again.
const OpTraits* FindOpTraits(const std::string& name);

}  // namespace memsim
