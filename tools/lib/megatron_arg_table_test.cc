// The table of Megatron-LM arguments against the parser of the release memsim follows
// (testdata/megatron_arguments.tsv, printed by tools/megatron_arguments.py from
// Megatron-LM d98e8a64): every argument a real launch line may hold has a row.
#include "tools/lib/megatron_arg_table.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>

namespace memsim {
namespace {

struct ParserOption {
  std::string attribute;  // what it sets: options setting the same one are one argument
  std::string arity;      // flag, value or values
};

std::map<std::string, ParserOption> ReadParserOptions() {
  std::ifstream in(std::string(MEMSIM_SOURCE_DIR) + "/tools/lib/testdata/megatron_arguments.tsv");
  EXPECT_TRUE(in.good());
  std::map<std::string, ParserOption> options;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string option;
    ParserOption o;
    std::getline(fields, option, '\t');
    std::getline(fields, o.attribute, '\t');
    std::getline(fields, o.arity, '\t');
    options[option] = o;
  }
  return options;
}

std::string ArityName(Arity arity) {
  switch (arity) {
    case Arity::kFlag:
      return "flag";
    case Arity::kValue:
      return "value";
    case Arity::kValues:
      return "values";
  }
  return "";
}

TEST(MegatronArgTable, EveryArgumentOfTheParserHasARow) {
  const std::map<std::string, ParserOption> options = ReadParserOptions();
  EXPECT_EQ(options.size(), 876u);  // the file's option lines
  for (const auto& [option, parsed] : options) {
    const MegatronArg* row = FindMegatronArg(option);
    ASSERT_NE(row, nullptr) << option << " has no row";
    // A row read or accepted takes its values as the parser does (a refused one stops).
    if (row->use == ArgUse::kRead || row->use == ArgUse::kNeutral) {
      EXPECT_EQ(ArityName(row->arity), parsed.arity) << option;
    } else {
      EXPECT_NE(row->reason, nullptr) << option;
    }
    // Another spelling sets what the row's argument sets.
    if (row->name != option) {
      ASSERT_EQ(options.count(row->name), 1u) << option << " -> " << row->name;
      EXPECT_EQ(options.at(row->name).attribute, parsed.attribute) << option;
    }
  }
}

TEST(MegatronArgTable, SpellingsAnswerTheirArgumentsRow) {
  EXPECT_STREQ(FindMegatronArg("--disable-tp-comm-bulk-dgrad")->name, "--no-tp-comm-bulk-dgrad");
  EXPECT_STREQ(FindMegatronArg("--persistent-save-interval")->name, "--save-interval");
  EXPECT_STREQ(FindMegatronArg("--no-tp-comm-bulk-dgrad")->name, "--no-tp-comm-bulk-dgrad");
  EXPECT_EQ(FindMegatronArg("--no-such-argument"), nullptr);
}

TEST(MegatronArgTable, RefusedArgumentsSayWhatTheyAre) {
  const auto& refused = UnmodelledMegatronArgs();
  EXPECT_EQ(refused.at("--moe-latent-size"), "MoE latent projections");
  EXPECT_EQ(refused.count("--batch-size"), 0u);  // Megatron-LM rejects it: not a refusal
  for (const auto& [name, what] : refused) EXPECT_FALSE(what.empty()) << name;
}

}  // namespace
}  // namespace memsim
