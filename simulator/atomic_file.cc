#include "simulator/atomic_file.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace memsim {
namespace fs = std::filesystem;

Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  const fs::path target(path);
  std::error_code ec;
  if (target.has_parent_path()) {
    fs::create_directories(target.parent_path(), ec);
    if (ec) {
      return Status::Error("cannot create directory '" + target.parent_path().string() +
                           "': " + ec.message() + "; choose a writable output folder");
    }
  }
  // Unique per call: threads of one process may write files at once.
  static std::atomic<uint64_t> counter{0};
  const std::string tmp =
      path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) {
      return Status::Error("cannot write '" + path + "': " + std::strerror(errno) +
                           "; choose a writable output folder");
    }
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    out.flush();
    if (!out) {
      out.close();
      std::remove(tmp.c_str());
      return Status::Error("cannot write '" + path + "': " + std::strerror(errno) +
                           " (disk full?)");
    }
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    std::remove(tmp.c_str());
    return Status::Error("cannot rename '" + tmp + "' to '" + path + "': " + ec.message());
  }
  return Status::OK();
}

Status EnsureWritableDirectory(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir, ec)) {
    return Status::Error("output folder '" + dir + "' cannot be created" +
                         (ec ? ": " + ec.message() : std::string(": a file is in the way")) +
                         "; pass a writable --out");
  }
  if (::access(dir.c_str(), W_OK) != 0) {
    return Status::Error("output folder '" + dir + "' is not writable: " + std::strerror(errno) +
                         "; pass a writable --out");
  }
  return Status::OK();
}

}  // namespace memsim
