// MEMSIM_DCHECK: aborts with the condition in Debug builds, evaluates nothing in release.
#include "simulator/check.h"

#include <gtest/gtest.h>

namespace memsim {
namespace {

TEST(Check, PassingConditionDoesNothing) {
  int evaluated = 0;
  MEMSIM_DCHECK(++evaluated == 1);
#ifdef NDEBUG
  EXPECT_EQ(evaluated, 0);  // compiled out: the side effect never happens
#else
  EXPECT_EQ(evaluated, 1);
#endif
}

#ifdef NDEBUG
TEST(Check, FailingConditionIsNotEvaluatedInRelease) {
  int evaluated = 0;
  MEMSIM_DCHECK(++evaluated == 2);
  EXPECT_EQ(evaluated, 0);
}
#else
TEST(CheckDeathTest, FailingConditionAbortsNamingIt) {
  const int blocks = 3;
  EXPECT_DEATH(MEMSIM_DCHECK(blocks == 4),
               "memsim: internal check failed: blocks == 4 \\(.*check_test.cc:[0-9]+\\)");
}
#endif

}  // namespace
}  // namespace memsim
