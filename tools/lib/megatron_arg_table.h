// The table of Megatron-LM's arguments: how `memsim megatron` uses each one.
//
// Note [Megatron arguments]
// One row per argument of Megatron-LM 0.20's parser (tools/megatron_arguments.py lists
// them; a test holds the table to that list), spelled as Megatron-LM spells it:
//   kRead      it decides memory and memsim models it (ParseMegatronArgs reads it, in the
//              group function of its section); with some values it is memory-neutral (e.g.
//              --cpu-offloading-num-layers 0) and lands in `ignored`, an error otherwise;
//   kNeutral   accepted and reported in `ignored`: schedules and hyperparameters of the
//              optimizer, data and tokenizer files, checkpointing, logging and profiling,
//              initialisation, kernel fusions and communication overlap that reuse the
//              same buffers (--overlap-param-gather: Megatron's DDP gathers in place in its
//              contiguous buffers; --overlap-grad-reduce is read: it buckets the
//              distributed optimizer's shards), RoPE variants (a rotation, not a tensor
//              size), sliding windows (the attention saves the same tensors with any mask),
//              inference and other models' settings, and the settings of features that are
//              off without their switch (FP8 settings without --fp8-format, MLA ranks
//              without --multi-latent-attention);
//   kRefused   it changes memory in a way memsim does not simulate; `reason` says what it
//              is, and the arity is not used (the argument stops parsing);
//   kRejected  Megatron-LM itself does not run with it (a deprecated spelling it stops at,
//              or an argument of older releases); `reason` says what to use instead.
// Options that set the same attribute (--disable-x and --no-x, which Megatron-Core's config
// dataclasses generate in pairs) are one argument: FindMegatronArg answers the row of the
// spelling the table holds. An argument in no row is an error too: memsim cannot tell
// whether it changes memory.
#pragma once

#include <map>
#include <string>

namespace memsim {

enum class Arity { kFlag, kValue, kValues };  // store_true, one value, nargs='*'/'+'
enum class ArgUse { kRead, kNeutral, kRefused, kRejected };

struct MegatronArg {
  const char* name;
  Arity arity;
  ArgUse use;
  const char* reason = nullptr;  // kRefused: what it is; kRejected: what to use instead
};

// The row of argument `name`, or of the argument it is another spelling of (then its
// name differs from `name`); null when Megatron-LM has no such argument.
const MegatronArg* FindMegatronArg(const std::string& name);

// The Megatron-LM arguments memsim refuses because they change memory in ways it does not
// model, each with what it is ("--fp4-format" -> "FP4 training"), sorted by name.
const std::map<std::string, std::string>& UnmodelledMegatronArgs();

}  // namespace memsim
