// memsim's exit codes: scripts tell "does not fit" from a failure.
#pragma once

namespace memsim {

inline constexpr int kExitOk = 0;
inline constexpr int kExitError = 2;       // bad input, unwritable output, internal failure
inline constexpr int kExitDoesNotFit = 3;  // --check: some rank exceeds the GPU's memory

}  // namespace memsim
