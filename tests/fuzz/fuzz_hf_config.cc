// libFuzzer target: Hugging Face config.json files.
#include <cstdint>

#include "tests/fuzz/fuzz_input.h"
#include "tools/lib/hf_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  memsim::ModelConfig model;
  const memsim::Status status =
      memsim::LoadHfConfig(memsim::fuzz::InputFile(data, size, ".json"), &model);
  if (status.ok()) (void)memsim::FinalizeModelConfig(&model);
  if (!status.ok() && status.message().find('\n') != std::string::npos) __builtin_trap();
  return 0;
}
