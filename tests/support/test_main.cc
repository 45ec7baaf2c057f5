// The tests' main: every test may run ops on meta tensors, so ops/ registers its
// kernels first (the engine's entry points do the same; see ops/ops.h).
#include <gtest/gtest.h>

#include "ops/ops.h"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  memsim::RegisterOps();
  return RUN_ALL_TESTS();
}
