// AtomicFileWriter: a file appears whole or not at all, and copies are published the same way.
#include "simulator/atomic_file.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>

namespace memsim {
namespace {

namespace fs = std::filesystem;

// A fresh folder per test: ctest runs the tests of this file in parallel processes.
std::string FreshDir() {
  const std::string dir = ::testing::TempDir() + "/memsim_atomic_file_test/" +
                          ::testing::UnitTest::GetInstance()->current_test_info()->name();
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string Contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

size_t FilesIn(const std::string& dir) {
  return static_cast<size_t>(std::distance(fs::directory_iterator(dir), {}));
}

TEST(AtomicFileWriter, CopiesThenTheFileItselfArePublished) {
  const std::string dir = FreshDir();
  std::unique_ptr<AtomicFileWriter> file;
  ASSERT_TRUE(AtomicFileWriter::Open(dir + "/a", &file).ok());
  file->stream() << "hello ";
  file->stream() << "world";
  EXPECT_EQ(file->size_bytes(), 11);
  EXPECT_FALSE(fs::exists(dir + "/a"));  // nothing in place before Publish
  ASSERT_TRUE(file->PublishCopy(dir + "/b").ok());
  ASSERT_TRUE(file->Publish(dir + "/c").ok());
  EXPECT_EQ(Contents(dir + "/b"), "hello world");
  EXPECT_EQ(Contents(dir + "/c"), "hello world");
  file.reset();
  EXPECT_EQ(FilesIn(dir), 2u);  // b and c: no temporary left, and nothing at `a`
}

TEST(AtomicFileWriter, AnUnpublishedFileLeavesNothing) {
  const std::string dir = FreshDir();
  std::ofstream(dir + "/old") << "old";
  {
    std::unique_ptr<AtomicFileWriter> file;
    ASSERT_TRUE(AtomicFileWriter::Open(dir + "/old", &file).ok());
    file->stream() << "new";
    EXPECT_EQ(FilesIn(dir), 2u);  // the old file and the temporary
  }
  EXPECT_EQ(FilesIn(dir), 1u);
  EXPECT_EQ(Contents(dir + "/old"), "old");  // untouched
}

TEST(AtomicFileWriter, AnUnwritablePathIsNamed) {
  std::unique_ptr<AtomicFileWriter> file;
  const Status status = AtomicFileWriter::Open("/proc/memsim_cannot_write/x", &file);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("/proc/memsim_cannot_write"), std::string::npos);
  EXPECT_EQ(file, nullptr);
}

}  // namespace
}  // namespace memsim
