// libFuzzer target: validation case files and tolerance files.
#include <cstdint>
#include <map>

#include "tests/fuzz/fuzz_input.h"
#include "tools/lib/validate.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = memsim::fuzz::InputFile(data, size, ".yaml");
  memsim::ValidationCase validation_case;
  const memsim::Status loaded = memsim::LoadValidationCase(path, &validation_case);
  std::map<std::string, memsim::Tolerance> tolerances;
  const memsim::Status tolerated = memsim::LoadTolerances(path, &tolerances);
  for (const memsim::Status& s : {loaded, tolerated}) {
    if (!s.ok() && s.message().find('\n') != std::string::npos) __builtin_trap();
  }
  return 0;
}
