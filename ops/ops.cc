#include "ops/ops.h"

#include "ops/collectives.h"
#include "ops/fused_optimizers.h"
#include "ops/meta_kernels.h"
#include "ops/transformer_kernels.h"

namespace memsim {

void RegisterOps() {
  RegisterMetaKernels();
  RegisterFusedOptimizers();
  RegisterTransformerKernels();
  RegisterCollectives();
}

}  // namespace memsim
