// libFuzzer target: Megatron-LM launch lines (whitespace-separated arguments) on 8 GPUs,
// then the checks before simulation.
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "tools/lib/megatron_args.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::istringstream line(std::string(reinterpret_cast<const char*>(data), size));
  std::vector<std::string> args;
  for (std::string token; line >> token;) args.push_back(token);
  memsim::MegatronArgsResult result;
  memsim::Status status = memsim::ParseMegatronArgs(args, {}, 8, &result);
  std::optional<memsim::ValidatedRun> run;
  if (status.ok()) status = memsim::FinalizeRunSpec(result.spec, &run);
  if (!status.ok() && status.message().find('\n') != std::string::npos) __builtin_trap();
  return 0;
}
