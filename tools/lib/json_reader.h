// Reading JSON that users and other tools hand memsim (Hugging Face configs, sweep
// records): bounded nesting, one-line errors.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

#include "simulator/status.h"

namespace memsim {

// Deeper nesting than this is refused while parsing: no real config nests more than a
// few levels, and deep values would exhaust the stack wherever they are printed.
inline constexpr int kMaxJsonDepth = 64;

// Parses the file at `path` into `out`. A missing file, malformed JSON or nesting deeper
// than kMaxJsonDepth is an error naming the file (and the byte, for malformed JSON).
Status ParseJsonFile(const std::string& path, nlohmann::json* out);

}  // namespace memsim
