#include "tools/lib/heap_tuning.h"

#include <cstdlib>  // defines __GLIBC__ on glibc

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace memsim {

void KeepFreedMemoryMapped() {
#if defined(__GLIBC__)
  // mallopt's ceiling for the threshold on 64-bit glibc: 4 MiB * sizeof(long).
  constexpr int kMmapThresholdBytes = 32 * 1024 * 1024;
  mallopt(M_MMAP_THRESHOLD, kMmapThresholdBytes);
  // The heap's free top goes back to the system only above 256 MiB.
  mallopt(M_TRIM_THRESHOLD, 256 * 1024 * 1024);
#endif
}

}  // namespace memsim
