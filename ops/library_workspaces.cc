#include "ops/library_workspaces.h"

#include <regex>

#include "simulator/checked_math.h"

namespace memsim {

int64_t DefaultCublasWorkspaceBytes(const GpuSpec& gpu) {
  const int major = gpu.compute_capability / 10;
  if (major == 9 || major == 10 || major == 12) return 32ll << 20;
  return 4096 * 1024 * 2 + 16 * 1024 * 8;
}

Status ParseCublasWorkspaceConfig(const std::string& text, int64_t* bytes) {
  static const std::regex pair(":([0-9]{1,9}):([0-9]{1,9})");
  int64_t total = 0;
  auto it = std::sregex_iterator(text.begin(), text.end(), pair);
  if (it == std::sregex_iterator()) {
    return Status::Error("CUBLAS_WORKSPACE_CONFIG '" + text +
                         "' has no :SIZE_KIB:COUNT pair (e.g. :4096:8)");
  }
  for (; it != std::sregex_iterator(); ++it) {
    total =
        CheckedAdd(total, CheckedMul(CheckedMul(std::stoll((*it)[1]), 1024), std::stoll((*it)[2])));
  }
  *bytes = total;
  return Status::OK();
}

int64_t TransformerEngineWorkspaceBytes(const GpuSpec& gpu) {
  return gpu.compute_capability >= 90 ? (32ll << 20) + 1024 : 4194304;
}

}  // namespace memsim
