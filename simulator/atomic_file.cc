#include "simulator/atomic_file.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "simulator/check.h"

namespace memsim {
namespace fs = std::filesystem;
namespace {

// A temporary's name beside `path`, unique per call: threads of one process may write files
// at once.
std::string TemporaryPathFor(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
}

Status RenameInto(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec) {
    std::remove(from.c_str());
    return Status::Error("cannot rename '" + from + "' to '" + to + "': " + ec.message());
  }
  return Status::OK();
}

}  // namespace

Status AtomicFileWriter::Open(const std::string& path, std::unique_ptr<AtomicFileWriter>* writer) {
  const fs::path target(path);
  std::error_code ec;
  if (target.has_parent_path()) {
    fs::create_directories(target.parent_path(), ec);
    if (ec) {
      return Status::Error("cannot create directory '" + target.parent_path().string() +
                           "': " + ec.message() + "; choose a writable output folder");
    }
  }
  std::unique_ptr<AtomicFileWriter> w(new AtomicFileWriter(path, TemporaryPathFor(path)));
  w->out_.open(w->temporary_path_, std::ios::binary | std::ios::trunc);
  if (!w->out_) {
    w->temporary_path_.clear();  // nothing was created
    return Status::Error("cannot write '" + path + "': " + std::strerror(errno) +
                         "; choose a writable output folder");
  }
  *writer = std::move(w);
  return Status::OK();
}

AtomicFileWriter::~AtomicFileWriter() {
  if (temporary_path_.empty()) return;
  out_.close();
  std::remove(temporary_path_.c_str());
}

int64_t AtomicFileWriter::size_bytes() {
  MEMSIM_DCHECK(!temporary_path_.empty());
  return static_cast<int64_t>(out_.tellp());
}

Status AtomicFileWriter::WriteError() const {
  return Status::Error("cannot write '" + path_ + "': " + std::strerror(errno) + " (disk full?)");
}

Status AtomicFileWriter::Close() {
  out_.close();
  return out_ ? Status::OK() : WriteError();
}

Status AtomicFileWriter::PublishCopy(const std::string& path) {
  MEMSIM_DCHECK(!temporary_path_.empty());
  out_.flush();
  if (!out_) return WriteError();
  const std::string copy = TemporaryPathFor(path);
  std::error_code ec;
  fs::copy_file(temporary_path_, copy, fs::copy_options::overwrite_existing, ec);
  if (ec) {
    std::remove(copy.c_str());
    return Status::Error("cannot write '" + path + "': " + ec.message() + " (disk full?)");
  }
  return RenameInto(copy, path);
}

Status AtomicFileWriter::Publish(const std::string& path) {
  MEMSIM_DCHECK(!temporary_path_.empty());
  const std::string temporary = std::move(temporary_path_);
  temporary_path_.clear();
  if (Status s = Close(); !s.ok()) {
    std::remove(temporary.c_str());
    return s;
  }
  return RenameInto(temporary, path);
}

Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  std::unique_ptr<AtomicFileWriter> writer;
  MEMSIM_RETURN_IF_ERROR(AtomicFileWriter::Open(path, &writer));
  writer->stream().write(contents.data(), static_cast<std::streamsize>(contents.size()));
  return writer->Publish();
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
