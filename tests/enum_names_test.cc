// Note [Enum names]: every table names each value once for printing, parses every name it
// lists back to its value, and refuses others listing every choice.
#include "simulator/enum_names.h"

#include <gtest/gtest.h>

#include <set>

#include "parallel/layout.h"
#include "parallel/theoretical_memory.h"
#include "simulator/attribution.h"
#include "tools/lib/plan.h"

namespace memsim {
namespace {

// Every entry parses to its value; a value prints as its first entry; `values` distinct
// values are covered.
template <typename E, size_t N>
void ExpectRoundTrips(const EnumName<E> (&table)[N], size_t values) {
  std::set<E> seen;
  for (const EnumName<E>& entry : table) {
    E parsed{};
    ASSERT_TRUE(ParseEnum(table, std::string(entry.name), "thing", &parsed).ok()) << entry.name;
    EXPECT_EQ(parsed, entry.value) << entry.name;
    if (seen.insert(entry.value).second) {
      EXPECT_EQ(NameOf(table, entry.value), entry.name);
    }
  }
  EXPECT_EQ(seen.size(), values);
}

TEST(EnumNames, EveryTableRoundTrips) {
  ExpectRoundTrips(kPhaseNames, kNumPhases);
  ExpectRoundTrips(kCategoryNames, kNumCategories);
  ExpectRoundTrips(kPrecisionNames, 3);
  ExpectRoundTrips(kActivationNames, 5);
  ExpectRoundTrips(kSoftmaxNames, 3);
  ExpectRoundTrips(kAttentionNames, 3);
  ExpectRoundTrips(kRecomputeNames, 3);
  ExpectRoundTrips(kRecomputeMethodNames, 2);
  ExpectRoundTrips(kOptimizerNames, 3);
  ExpectRoundTrips(kProfileNames, 2);
  ExpectRoundTrips(kDataParallelNames, 5);
  ExpectRoundTrips(kPlanVerdictNames, 6);
  ExpectRoundTrips(kTheoreticalActivationFormulaNames, 2);
}

TEST(EnumNames, AliasesParseButDoNotPrint) {
  DataParallelKind kind = DataParallelKind::kDdp;
  ASSERT_TRUE(ParseEnum(kDataParallelNames, "zero3", "data parallelism", &kind).ok());
  EXPECT_EQ(kind, DataParallelKind::kFsdp);
  EXPECT_EQ(DataParallelName(kind), "fsdp");
  EXPECT_EQ(DataParallelName(DataParallelKind::kDistributedOptimizer), "distributed-optimizer");
}

TEST(EnumNames, PrintedNamesListEachValueOnceInTableOrder) {
  EXPECT_EQ(PrintedNames(kPhaseNames),
            (std::vector<std::string>{"setup", "forward", "backward", "optimizer"}));
  // The aliases zero1, zero2 and zero3 are left out.
  EXPECT_EQ(
      PrintedNames(kDataParallelNames),
      (std::vector<std::string>{"ddp", "distributed-optimizer", "zero2", "fsdp", "megatron-fsdp"}));
}

TEST(EnumNames, UnknownNameListsEveryChoiceAlphabetically) {
  DataParallelKind kind = DataParallelKind::kDdp;
  const Status status = ParseEnum(kDataParallelNames, "zero4", "data parallelism", &kind);
  EXPECT_EQ(status.message(),
            "unknown data parallelism 'zero4' (use one of: ddp, distributed-optimizer, fsdp, "
            "megatron-fsdp, "
            "zero1, zero2, zero3)");
  EXPECT_EQ(kind, DataParallelKind::kDdp);  // untouched
  Precision precision = Precision::kBf16;
  EXPECT_EQ(ParseEnum(kPrecisionNames, "FP16", "precision", &precision).message(),
            "unknown precision 'FP16' (use one of: bf16, fp16, fp32)");
}

}  // namespace
}  // namespace memsim
