// Atomic file output: a killed run never leaves a half-written trace.
#pragma once

#include <string>
#include <string_view>

#include "simulator/status.h"

namespace memsim {

// Writes `contents` to `path` by writing `path`.tmp.<pid>.<n> and renaming it over `path`.
// Thread-safe.
// Creates missing parent directories. On failure nothing is left at `path` (an older
// file there stays untouched) and the message names the path and the OS error.
Status WriteFileAtomically(const std::string& path, std::string_view contents);

// Creates `dir` (and parents) if needed and checks that a file can be created in it.
Status EnsureWritableDirectory(const std::string& dir);

}  // namespace memsim
