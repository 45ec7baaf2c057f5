// Status: how user-facing failures travel (bad input, unwritable output, OOM checks).
//
// A Status is either OK or carries a one-line message that names the problem and how
// to fix it. Engine invariants that only a programming error can break use exceptions
// or MEMSIM_DCHECK (simulator/check.h) instead; everything a user can cause returns a
// Status.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace memsim {

// `text` with every control character (below 0x20, and 0x7f) written as \xNN.
inline std::string EscapeControl(std::string text) {
  static const char* const kHex = "0123456789abcdef";
  std::string out;
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      out += "\\x";
      out += kHex[u >> 4];
      out += kHex[u & 15];
    } else {
      out += c;
    }
  }
  return out;
}

class Status {
 public:
  Status() = default;  // OK
  static Status OK() { return Status(); }
  // Control characters in `message` (input echoed back, a newline) are written as \xNN,
  // so that a message is always one printable line.
  static Status Error(std::string message) { return Status(EscapeControl(std::move(message))); }

  bool ok() const { return !failed_; }
  const std::string& message() const { return message_; }

 private:
  explicit Status(std::string message) : failed_(true), message_(std::move(message)) {}
  bool failed_ = false;
  std::string message_;
};

// Thrown where a deep call cannot return a Status (inside a dispatcher callback, a
// model's forward); the command line turns it into a one-line error and exit code 2.
class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

#define MEMSIM_RETURN_IF_ERROR(expr)   \
  do {                                 \
    ::memsim::Status _status = (expr); \
    if (!_status.ok()) return _status; \
  } while (0)

}  // namespace memsim
