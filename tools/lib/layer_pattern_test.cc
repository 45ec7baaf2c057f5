#include "tools/lib/layer_pattern.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace memsim {
namespace {

std::vector<int64_t> Eval(const std::string& text) {
  std::vector<int64_t> out;
  const Status status = EvaluateLayerPattern(text, &out);
  EXPECT_TRUE(status.ok()) << text << ": " << status.message();
  return out;
}

std::string ErrorOf(const std::string& text) {
  std::vector<int64_t> out;
  const Status status = EvaluateLayerPattern(text, &out);
  return status.ok() ? "" : status.message();
}

// The examples of Megatron-LM's help texts, with Python's values.
TEST(LayerPattern, EvaluatesAsPythonDoes) {
  EXPECT_EQ(Eval("([0]*3+[1]*1)*3"), (std::vector<int64_t>{0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1}));
  EXPECT_EQ(Eval("([1]+[0]*23)").size(), 24u);
  EXPECT_EQ(Eval("([1]+[0]*23)")[0], 1);
  EXPECT_EQ(Eval("[0,1,1]"), (std::vector<int64_t>{0, 1, 1}));
  EXPECT_EQ(Eval("2*[1,0]"), (std::vector<int64_t>{1, 0, 1, 0}));
  EXPECT_EQ(Eval("[1]*(1+2)"), (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(Eval("[0]*2+[1]"), (std::vector<int64_t>{0, 0, 1}));  // * binds tighter than +
  EXPECT_EQ(Eval("[1*2,3]"), (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(Eval("[]").empty());
  EXPECT_TRUE(Eval("[1]*0").empty());
  EXPECT_TRUE(Eval("[]*1099511627776").empty());            // nothing to repeat: no work either
  EXPECT_EQ(Eval("[0,1,]"), (std::vector<int64_t>{0, 1}));  // a trailing comma
  EXPECT_EQ(Eval("[+1]"), (std::vector<int64_t>{1}));
  EXPECT_EQ(Eval("[0]*2**3").size(), 8u);                     // ** binds tighter than *
  EXPECT_EQ(Eval("[2**3**2]"), (std::vector<int64_t>{512}));  // and to the right
  EXPECT_EQ(Eval("[00,0]"), (std::vector<int64_t>{0, 0}));
}

TEST(LayerPattern, RefusesWhatIsNotAPattern) {
  EXPECT_NE(ErrorOf("[0] * 3").find("no spaces"), std::string::npos);
  EXPECT_NE(ErrorOf("__import__('os')").find("'_'"), std::string::npos);
  EXPECT_NE(ErrorOf("4").find("not a list"), std::string::npos);
  EXPECT_NE(ErrorOf("[0]*[1]").find("two lists"), std::string::npos);
  EXPECT_NE(ErrorOf("[0]+1").find("a list and an integer"), std::string::npos);
  EXPECT_NE(ErrorOf("[[0]]").find("a list inside a list"), std::string::npos);
  EXPECT_NE(ErrorOf("(0,1)").find("tuples"), std::string::npos);
  EXPECT_NE(ErrorOf("[0,1").find("']' expected"), std::string::npos);
  EXPECT_NE(ErrorOf("[0]*").find("unexpected end"), std::string::npos);
  EXPECT_NE(ErrorOf("[0]*99999999").find("more than"), std::string::npos);
  EXPECT_NE(ErrorOf(std::string(100, '(') + "[0]" + std::string(100, ')')).find("nested"),
            std::string::npos);
  EXPECT_NE(ErrorOf("[01]").find("leading zero"), std::string::npos);
  EXPECT_NE(ErrorOf("[0,,1]").find("unexpected ','"), std::string::npos);
  EXPECT_NE(ErrorOf("[2**99]").find("too large"), std::string::npos);
  std::string chain = "[0]*1048576";
  for (int i = 0; i < 100; ++i) chain += "*1";
  EXPECT_NE(ErrorOf(chain).find("elements to build"), std::string::npos);
  // One line whatever the text holds: shortened, unprintable characters escaped.
  const std::string error = ErrorOf("[0]\n" + std::string(100, '1'));
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  EXPECT_NE(error.find("\\x0a"), std::string::npos) << error;
  EXPECT_LT(error.size(), 200u) << error;
}

}  // namespace
}  // namespace memsim
