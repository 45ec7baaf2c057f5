// Megatron-LM's pretrain_gpt.py arguments -> RunSpec, for `memsim megatron -- ARGS`.
//
// Arguments are spelled exactly as Megatron-LM spells them, as `--arg value` or
// `--arg=value`. Every argument of Megatron-LM 0.20 has one row in one table
// (megatron_arg_table.h), which says whether it is read (it decides memory and memsim
// models it), memory-neutral (reported in `ignored`), not modelled (an error naming it),
// or one Megatron-LM itself stops at.
// Rules on the whole run (sequence vs CP, ...) are FinalizeRunSpec's (parallel/run_spec.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "simulator/status.h"
#include "tools/lib/run_config.h"

namespace memsim {

struct MegatronArgsResult {
  // model.name "megatron"; global_batch_size as given (0: Megatron-LM's default, one
  // microbatch an iteration). Not finalized: FinalizeRunSpec derives the data-parallel
  // size, the microbatches and the default FFN size, and checks the whole run.
  RunSpec spec;
  // Arguments that do not change memory (or not with the others given), as spelled,
  // in the order given, each once.
  std::vector<std::string> ignored;
  // What memsim decided where an argument varies during training (the largest batch of
  // --step-batch-size-schedule), a sentence each, to be shown to the user.
  std::vector<std::string> notes;
};

// `world_size` is the number of ranks (Megatron-LM takes it from WORLD_SIZE). `env` holds
// the launch's environment variables; each must be one memsim knows (MegatronEnvNames):
// those that change memory are modelled, the others are listed in `ignored`.
Status ParseMegatronArgs(const std::vector<std::string>& args,
                         const std::map<std::string, std::string>& env, int64_t world_size,
                         MegatronArgsResult* out);

// The environment variables memsim models (CUBLAS_WORKSPACE_CONFIG, NVTE_*_ATTN, ...):
// what `memsim megatron` reads from its own environment.
std::vector<std::string> ModelledEnvNames();

}  // namespace memsim
