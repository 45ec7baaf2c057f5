#include "simulator/check.h"

#include <cstdio>
#include <cstdlib>

namespace memsim::internal {

void DcheckFailed(const char* condition, const char* file, int line) {
  std::fprintf(stderr, "memsim: internal check failed: %s (%s:%d)\n", condition, file, line);
  std::abort();
}

}  // namespace memsim::internal
