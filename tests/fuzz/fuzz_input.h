// What every fuzz target shares: the input as a file, since memsim's readers take paths.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <string>

namespace memsim::fuzz {

// Writes the input to a file of this process (with `extension`) and returns its path.
inline std::string InputFile(const uint8_t* data, size_t size, const std::string& extension) {
  static const std::string path = "/tmp/memsim_fuzz_" + std::to_string(::getpid()) + extension;
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  return path;
}

}  // namespace memsim::fuzz
