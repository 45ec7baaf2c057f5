// `memsim megatron -- <pretrain_gpt.py arguments>`: simulate a Megatron-LM launch line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tools/lib/megatron_args.h"

namespace memsim {

// Reads a launch line as Megatron-LM would see it: `args` (pretrain_gpt.py's arguments),
// the world size (`world_size` when > 0, else WORLD_SIZE) and the environment variables
// memsim models. The spec is not finalized.
Status ReadLaunchLine(const std::vector<std::string>& args, int64_t world_size,
                      MegatronArgsResult* parsed);

// The index of "--" in argv (argc when there is none): memsim's options come before it.
int LaunchLineSeparator(int argc, const char* const* argv);

int MegatronCommand(int argc, const char* const* argv);

}  // namespace memsim
