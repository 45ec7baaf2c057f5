// Hugging Face config.json -> ModelConfig, for the decoder families memsim can build:
// Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5, Phi-3, gpt-oss,
// Gemma-2 and Gemma-3's text model (see hf_config.cc).
//
// Every key of the file is checked: a key that changes memory in a way memsim does not
// model, a key memsim does not know, a missing or mistyped key and an unsupported
// model_type are errors naming the file and the key.
#pragma once

#include <string>
#include <vector>

#include "models/model_config.h"
#include "simulator/status.h"

namespace memsim {

// Replaces `*model` with the architecture described by the config.json at `path`. The
// result is not finalized: call FinalizeModelConfig with the run's TP next.
// `approximations` (optional) receives one line per setting that memsim maps onto its
// nearest supported form or leaves out (an untrained MTP layer, for instance), and last a
// line listing the keys it ignored as memory-neutral (token ids, RoPE bases, sliding
// windows, ...). A key memsim does not know at all stays an error: it might change memory.
Status LoadHfConfig(const std::string& path, ModelConfig* model,
                    std::vector<std::string>* approximations = nullptr);

}  // namespace memsim
