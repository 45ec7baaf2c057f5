// Atomic file output: a killed run never leaves a half-written trace.
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <string_view>

#include "simulator/status.h"

namespace memsim {

// A file written in pieces and published atomically. Bytes go to a temporary beside the
// path given to Open (`path`.tmp.<pid>.<n>); Publish renames it into place, PublishCopy
// puts a copy of it in place the same way. A writer destroyed before Publish removes its
// temporary, so a failed or refused run leaves nothing behind.
// Threading: one thread at a time per writer; writers of one process may run at once.
class AtomicFileWriter {
 public:
  // Creates missing parent directories of `path` and opens the temporary. Errors name the
  // path and the OS error.
  static Status Open(const std::string& path, std::unique_ptr<AtomicFileWriter>* writer);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  AtomicFileWriter(AtomicFileWriter&&) = delete;
  AtomicFileWriter& operator=(AtomicFileWriter&&) = delete;

  // Where the bytes go. REQUIRES: not yet published.
  std::ostream& stream() { return out_; }
  // The bytes written so far. REQUIRES: not yet published.
  int64_t size_bytes();
  // Publishes a copy of what was written as `path`, atomically.
  // REQUIRES: not yet published.
  Status PublishCopy(const std::string& path);
  // Renames the temporary over `path` (the path given to Open when omitted); the writer
  // is done after it. REQUIRES: not yet published; `path` on the temporary's file system.
  Status Publish(const std::string& path);
  Status Publish() { return Publish(path_); }

 private:
  AtomicFileWriter(std::string path, std::string temporary_path)
      : path_(std::move(path)), temporary_path_(std::move(temporary_path)) {}
  // Flushes and closes the temporary; an error if any write failed.
  Status Close();
  // A write to the temporary failed: the message names the file and the OS error.
  Status WriteError() const;

  std::string path_;
  std::string temporary_path_;  // empty once published
  std::ofstream out_;
};

// Writes `contents` to `path` through an AtomicFileWriter. Thread-safe.
// On failure nothing is left at `path` (an older file there stays untouched) and the
// message names the path and the OS error.
Status WriteFileAtomically(const std::string& path, std::string_view contents);

// Creates `dir` (and parents) if needed and checks that a file can be created in it.
Status EnsureWritableDirectory(const std::string& dir);

}  // namespace memsim
