// libFuzzer target: the sweep records that merge and --resume read back.
#include <cstdint>

#include "tests/fuzz/fuzz_input.h"
#include "tools/lib/sweep.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json record;
  const memsim::Status status =
      memsim::LoadSweepRecord(memsim::fuzz::InputFile(data, size, ".json"), &record);
  if (!status.ok() && status.message().find('\n') != std::string::npos) __builtin_trap();
  return 0;
}
