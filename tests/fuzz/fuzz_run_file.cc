// libFuzzer target: YAML run files and the model presets they name, then every check a
// run goes through before it simulates. Any input must end in OK or a one-line Status.
#include <cstdint>

#include "tests/fuzz/fuzz_input.h"
#include "tools/lib/run_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  memsim::RunSpec spec;
  memsim::Status status = memsim::LoadRunFile(memsim::fuzz::InputFile(data, size, ".yaml"), &spec);
  std::optional<memsim::ValidatedRun> run;
  if (status.ok()) status = memsim::FinalizeRunSpec(spec, &run);
  if (!status.ok() && status.message().find('\n') != std::string::npos) __builtin_trap();
  return 0;
}
