#include "tools/lib/layer_pattern.h"

#include <utility>

namespace memsim {
namespace {

constexpr int64_t kMaxInteger = int64_t{1} << 40;
constexpr int kMaxNesting = 64;  // brackets and parentheses, so that recursion stays shallow

// A value of the expression: an integer or a list of integers.
struct Value {
  bool is_list = false;
  int64_t integer = 0;
  std::vector<int64_t> list;
};

// Recursive descent over Python's precedence: sum := product ('+' product)*;
// product := atom ('*' atom)*; atom := integer | '[' [sum (',' sum)*] ']' | '(' sum ')'.
// Nesting is bounded by kMaxNesting.
class PatternParser {
 public:
  explicit PatternParser(const std::string& text) : text_(text) {}

  Status Parse(Value* out) {
    MEMSIM_RETURN_IF_ERROR(Sum(out));
    if (pos_ != text_.size()) return Fail("unexpected '" + std::string(1, text_[pos_]) + "'");
    return Status::OK();
  }

 private:
  Status Fail(const std::string& what) const {
    return Status::Error("pattern '" + text_ + "': " + what + " at character " +
                         std::to_string(pos_ + 1));
  }
  bool Accept(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }

  Status Sum(Value* out) {
    MEMSIM_RETURN_IF_ERROR(Product(out));
    while (Accept('+')) {
      Value right;
      MEMSIM_RETURN_IF_ERROR(Product(&right));
      if (out->is_list != right.is_list) return Fail("+ of a list and an integer");
      if (out->is_list) {
        if (static_cast<int64_t>(out->list.size() + right.list.size()) > kMaxPatternElements) {
          return Fail("more than " + std::to_string(kMaxPatternElements) + " elements");
        }
        out->list.insert(out->list.end(), right.list.begin(), right.list.end());
      } else {
        out->integer += right.integer;
        if (out->integer > kMaxInteger) return Fail("an integer too large");
      }
    }
    return Status::OK();
  }

  Status Product(Value* out) {
    MEMSIM_RETURN_IF_ERROR(Atom(out));
    while (Accept('*')) {
      Value right;
      MEMSIM_RETURN_IF_ERROR(Atom(&right));
      if (out->is_list && right.is_list) return Fail("* of two lists");
      if (!out->is_list && !right.is_list) {
        if (right.integer != 0 && out->integer > kMaxInteger / right.integer) {
          return Fail("an integer too large");
        }
        out->integer *= right.integer;
        continue;
      }
      std::vector<int64_t> items = out->is_list ? std::move(out->list) : std::move(right.list);
      const int64_t times = out->is_list ? right.integer : out->integer;
      if (!items.empty() && times > kMaxPatternElements / static_cast<int64_t>(items.size())) {
        return Fail("more than " + std::to_string(kMaxPatternElements) + " elements");
      }
      out->is_list = true;
      out->list.clear();
      for (int64_t i = 0; i < times; ++i)
        out->list.insert(out->list.end(), items.begin(), items.end());
    }
    return Status::OK();
  }

  Status Atom(Value* out) {
    *out = Value();
    if (pos_ < text_.size() && (text_[pos_] == '(' || text_[pos_] == '[')) {
      if (++depth_ > kMaxNesting) return Fail("nested deeper than " + std::to_string(kMaxNesting));
      const Status status = Nested(out);
      --depth_;
      return status;
    }
    return Integer(out);
  }

  // '(' sum ')' or '[' [sum (',' sum)*] ']'.
  Status Nested(Value* out) {
    if (Accept('(')) {
      MEMSIM_RETURN_IF_ERROR(Sum(out));
      if (!Accept(')')) return Fail("')' expected (tuples are not patterns)");
      return Status::OK();
    }
    Accept('[');
    out->is_list = true;
    if (Accept(']')) return Status::OK();
    do {
      Value item;
      MEMSIM_RETURN_IF_ERROR(Sum(&item));
      if (item.is_list) return Fail("a list inside a list");
      out->list.push_back(item.integer);
    } while (Accept(','));
    if (!Accept(']')) return Fail("']' expected");
    return Status::OK();
  }

  Status Integer(Value* out) {
    const size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      out->integer = out->integer * 10 + (text_[pos_] - '0');
      if (out->integer > kMaxInteger) return Fail("an integer too large");
      ++pos_;
    }
    if (pos_ == start) {
      return pos_ < text_.size() ? Fail("unexpected '" + std::string(1, text_[pos_]) + "'")
                                 : Fail("unexpected end");
    }
    return Status::OK();
  }

  const std::string& text_;
  size_t pos_ = 0;
  int depth_ = 0;
};

}  // namespace

Status EvaluateLayerPattern(const std::string& text, std::vector<int64_t>* out) {
  for (char c : text) {
    const bool allowed = (c >= '0' && c <= '9') || c == ',' || c == '[' || c == ']' || c == '(' ||
                         c == ')' || c == '+' || c == '*';
    if (!allowed) {
      return Status::Error("pattern '" + text + "' has '" + std::string(1, c) +
                           "': Megatron-LM allows only digits, commas, brackets, parentheses, + "
                           "and * (no spaces)");
    }
  }
  if (static_cast<int64_t>(text.size()) > kMaxPatternElements) {
    return Status::Error("pattern of " + std::to_string(text.size()) + " characters is too long");
  }
  Value value;
  MEMSIM_RETURN_IF_ERROR(PatternParser(text).Parse(&value));
  if (!value.is_list) {
    return Status::Error("pattern '" + text + "' is an integer, not a list of one per layer");
  }
  *out = std::move(value.list);
  return Status::OK();
}

}  // namespace memsim
