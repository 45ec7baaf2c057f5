#include "tools/lib/layer_pattern.h"

#include <cstdio>
#include <utility>

namespace memsim {
namespace {

constexpr int64_t kMaxInteger = int64_t{1} << 40;
constexpr int kMaxNesting = 64;  // brackets, parentheses and unary +: recursion stays shallow
constexpr size_t kMaxPatternChars = 64 * 1024;
// Elements copied by + and * together: bounds the work of chains such as [0]*N*1*1*...
constexpr int64_t kMaxCopiedElements = int64_t{1} << 24;

// `text` as a message shows it: at most 40 characters, anything unprintable as \xNN.
std::string Shown(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size() && i < 40; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char escaped[5];
      std::snprintf(escaped, sizeof(escaped), "\\x%02x", c);
      out += escaped;
    }
  }
  return text.size() > 40 ? out + "..." : out;
}

// A value of the expression: an integer or a list of integers.
struct Value {
  bool is_list = false;
  int64_t integer = 0;
  std::vector<int64_t> list;
};

// Recursive descent over Python's precedence: sum := product ('+' product)*;
// product := unary ('*' unary)*; unary := '+' unary | power; power := atom ['**' unary];
// atom := integer | '[' [sum (',' sum)* [',']] ']' | '(' sum ')'. Nesting is bounded by
// kMaxNesting, the work of + and * by kMaxCopiedElements.
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
    return Status::Error("pattern '" + Shown(text_) + "': " + what + " at character " +
                         std::to_string(pos_ + 1));
  }
  bool Accept(const char* token) {
    const std::string t(token);
    if (text_.compare(pos_, t.size(), t) != 0) return false;
    pos_ += t.size();
    return true;
  }
  bool Next(char c) const { return pos_ < text_.size() && text_[pos_] == c; }
  // Counts `elements` copied; an error past the budget.
  Status Copy(int64_t elements) {
    copied_ += elements;
    if (copied_ > kMaxCopiedElements) {
      return Fail("more than " + std::to_string(kMaxCopiedElements) + " elements to build");
    }
    return Status::OK();
  }
  // Guards recursion into `parse`.
  template <typename Fn>
  Status Nested(Fn&& parse) {
    if (++depth_ > kMaxNesting) return Fail("nested deeper than " + std::to_string(kMaxNesting));
    const Status status = parse();
    --depth_;
    return status;
  }

  Status Sum(Value* out) {
    MEMSIM_RETURN_IF_ERROR(Product(out));
    while (Accept("+")) {
      Value right;
      MEMSIM_RETURN_IF_ERROR(Product(&right));
      if (out->is_list != right.is_list) return Fail("+ of a list and an integer");
      if (!out->is_list) {
        out->integer += right.integer;
        if (out->integer > kMaxInteger) return Fail("an integer too large");
        continue;
      }
      if (static_cast<int64_t>(out->list.size() + right.list.size()) > kMaxPatternElements) {
        return Fail("more than " + std::to_string(kMaxPatternElements) + " elements");
      }
      MEMSIM_RETURN_IF_ERROR(Copy(static_cast<int64_t>(right.list.size())));
      out->list.insert(out->list.end(), right.list.begin(), right.list.end());
    }
    return Status::OK();
  }

  Status Product(Value* out) {
    MEMSIM_RETURN_IF_ERROR(Unary(out));
    // "**" is a power, not two products.
    while (Next('*') && !(pos_ + 1 < text_.size() && text_[pos_ + 1] == '*')) {
      ++pos_;
      Value right;
      MEMSIM_RETURN_IF_ERROR(Unary(&right));
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
      out->is_list = true;
      out->list.clear();
      if (items.empty() || times == 0) continue;
      const int64_t size = static_cast<int64_t>(items.size());
      if (times > kMaxPatternElements / size) {
        return Fail("more than " + std::to_string(kMaxPatternElements) + " elements");
      }
      MEMSIM_RETURN_IF_ERROR(Copy(size * times));
      for (int64_t i = 0; i < times; ++i)
        out->list.insert(out->list.end(), items.begin(), items.end());
    }
    return Status::OK();
  }

  Status Unary(Value* out) {
    if (!Accept("+")) return Power(out);
    return Nested([&] {
      MEMSIM_RETURN_IF_ERROR(Unary(out));
      if (out->is_list) return Fail("unary + of a list");
      return Status::OK();
    });
  }

  Status Power(Value* out) {
    MEMSIM_RETURN_IF_ERROR(Atom(out));
    if (!Accept("**")) return Status::OK();
    Value exponent;
    MEMSIM_RETURN_IF_ERROR(Nested([&] { return Unary(&exponent); }));
    if (out->is_list || exponent.is_list) return Fail("** of a list");
    int64_t result = 1;
    for (int64_t i = 0; i < exponent.integer; ++i) {
      if (out->integer != 0 && result > kMaxInteger / out->integer) {
        return Fail("an integer too large");
      }
      result *= out->integer;
      if (result == 0 || result == 1) break;  // stays what it is
    }
    out->integer = result;
    return Status::OK();
  }

  Status Atom(Value* out) {
    *out = Value();
    if (Accept("(")) {
      return Nested([&] {
        MEMSIM_RETURN_IF_ERROR(Sum(out));
        if (!Accept(")")) return Fail("')' expected (tuples are not patterns)");
        return Status::OK();
      });
    }
    if (Accept("[")) {
      return Nested([&] {
        out->is_list = true;
        while (!Accept("]")) {
          Value item;
          MEMSIM_RETURN_IF_ERROR(Sum(&item));
          if (item.is_list) return Fail("a list inside a list");
          out->list.push_back(item.integer);
          if (!Accept(",") && !Next(']')) return Fail("',' or ']' expected");
        }
        return Status::OK();
      });
    }
    return Integer(out);
  }

  // A decimal integer as Python reads one: no leading zeros but in 0, 00, ...
  Status Integer(Value* out) {
    const size_t start = pos_;
    bool nonzero = false;
    while (Next('0') || (pos_ < text_.size() && text_[pos_] >= '1' && text_[pos_] <= '9')) {
      if (text_[pos_] != '0') {
        if (!nonzero && pos_ > start) return Fail("a leading zero (Python refuses it)");
        nonzero = true;
      }
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
  int64_t copied_ = 0;
};

}  // namespace

Status EvaluateLayerPattern(const std::string& text, std::vector<int64_t>* out) {
  if (text.size() > kMaxPatternChars) {
    return Status::Error("pattern of " + std::to_string(text.size()) +
                         " characters is too long (at most " + std::to_string(kMaxPatternChars) +
                         ")");
  }
  for (char c : text) {
    const bool allowed = (c >= '0' && c <= '9') || c == ',' || c == '[' || c == ']' || c == '(' ||
                         c == ')' || c == '+' || c == '*';
    if (!allowed) {
      return Status::Error("pattern '" + Shown(text) + "' has '" + Shown(std::string(1, c)) +
                           "': Megatron-LM allows only digits, commas, brackets, parentheses, + "
                           "and * (no spaces)");
    }
  }
  Value value;
  MEMSIM_RETURN_IF_ERROR(PatternParser(text).Parse(&value));
  if (!value.is_list) {
    return Status::Error("pattern '" + Shown(text) +
                         "' is an integer, not a list of one per layer");
  }
  *out = std::move(value.list);
  return Status::OK();
}

}  // namespace memsim
