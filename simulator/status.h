// Status: how user-facing failures travel (bad input, unwritable output, OOM checks).
//
// A Status is either OK or carries a one-line message that names the problem and how
// to fix it. Engine invariants that only a programming error can break use
// exceptions or asserts instead; everything a user can cause returns a Status.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace memsim {

class Status {
 public:
  Status() = default;  // OK
  static Status OK() { return Status(); }
  static Status Error(std::string message) { return Status(std::move(message)); }

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
