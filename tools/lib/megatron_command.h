// `memsim megatron -- <pretrain_gpt.py arguments>`: simulate a Megatron-LM launch line.
#pragma once

namespace memsim {

int MegatronCommand(int argc, const char* const* argv);

}  // namespace memsim
