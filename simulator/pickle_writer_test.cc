// PickleWriter against an independent reader: Python's pickle module loads what it wrote,
// and the values printed back are the ones worked out here by hand.
#include "simulator/pickle_writer.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

namespace memsim {
namespace {

// Loads `bytes` with Python's pickle and returns what `expression` (of the loaded value
// `v`) prints.
std::string PythonReads(const std::string& bytes, const std::string& expression) {
  // One file per test: ctest runs the tests of this file in parallel processes.
  const std::string dir = ::testing::TempDir() + "/memsim_pickle_writer_test";
  std::filesystem::create_directories(dir);
  const std::string path =
      dir + "/" + ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".pickle";
  std::ofstream(path, std::ios::binary) << bytes;
  const std::string command = "python3 -c \"import pickle; v = pickle.load(open('" + path +
                              "', 'rb')); print(" + expression + ")\"";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return "<popen failed>";
  std::string out;
  char buffer[4096];
  while (fgets(buffer, sizeof(buffer), pipe) != nullptr) out += buffer;
  if (pclose(pipe) != 0) return "<python failed: " + out + ">";
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

TEST(PickleWriter, ScalarsAtTheEdgesOfEachEncoding) {
  PickleWriter w;
  w.BeginList();
  for (int64_t v : {int64_t{0}, int64_t{-1}, int64_t{255}, int64_t{2147483647},
                    int64_t{-2147483648}, int64_t{2147483648}, int64_t{-2147483649}, int64_t{256},
                    int64_t{65535}, int64_t{65536}, int64_t{549755813887}, int64_t{549755813888},
                    int64_t{-549755813888}, int64_t{-549755813889},
                    std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()}) {
    w.Int(v);
  }
  w.Bool(true);
  w.Bool(false);
  w.Pair(3, -4);
  w.String("");
  w.String("caf\xc3\xa9");  // UTF-8 for "café"
  w.EndList();
  EXPECT_EQ(PythonReads(w.Finish(), "repr(v)"),
            "[0, -1, 255, 2147483647, -2147483648, 2147483648, -2147483649, 256, 65535, 65536, "
            "549755813887, 549755813888, -549755813888, -549755813889, "
            "9223372036854775807, -9223372036854775808, True, False, (3, -4), '', 'café']");
}

TEST(PickleWriter, NestedAndEmptyContainersKeepTheirOrder) {
  PickleWriter w;
  w.BeginDict();
  w.String("b");
  w.BeginList();
  w.EndList();
  w.String("a");
  w.BeginDict();
  w.EndDict();
  w.String("c");
  w.BeginList();
  w.BeginList();
  w.Int(1);
  w.EndList();
  w.BeginDict();
  w.String("x");
  w.Int(2);
  w.EndDict();
  w.EndList();
  w.EndDict();
  EXPECT_EQ(PythonReads(w.Finish(), "repr(v)"), "{'b': [], 'a': {}, 'c': [[1], {'x': 2}]}");
}

// More than 256 memoized values switches the memo opcodes to 4-byte indices; a remembered
// list referenced later is the same Python object.
TEST(PickleWriter, MemoizedStringsAndSharedListsPastOneByteIndices) {
  PickleWriter w;
  w.BeginList();
  w.BeginList();
  const int64_t shared = w.Remember();
  w.Int(7);
  w.EndList();
  for (int i = 0; i < 300; ++i) w.String("s" + std::to_string(i));
  w.String("s299");  // a repeat: written as a reference
  w.String("s0");
  w.Reference(shared);
  w.EndList();
  const std::string bytes = w.Finish();
  EXPECT_EQ(PythonReads(bytes, "len(v), v[0] is v[-1], v[0], v[-2], v[-3], v[1], v[300]"),
            "304 True [7] s0 s299 s0 s299");
  // "s299" and "s0" were written once: the bytes hold each name one time.
  EXPECT_EQ(bytes.find("s299"), bytes.rfind("s299"));
}

TEST(PickleWriter, FinishStartsAFreshPickle) {
  PickleWriter w;
  w.String("first");
  EXPECT_EQ(PythonReads(w.Finish(), "v"), "first");
  w.String("first");  // no longer memoized: a reference would point at nothing
  EXPECT_EQ(PythonReads(w.Finish(), "v"), "first");
}

// Writes a list of `n` dicts {"key": i, "name": "n<i mod 7>"} with keys as literals.
void WriteDicts(PickleWriter* w, int n) {
  w->BeginList();
  for (int i = 0; i < n; ++i) {
    w->BeginDict();
    w->Literal("key");
    w->Int(i);
    w->Literal("name");
    w->String("n" + std::to_string(i % 7));
    w->EndDict();
  }
  w->EndList();
}

TEST(PickleWriter, AStreamGetsTheSameBytesInChunks) {
  // 200000 dicts are about 2.4 MB: more than two chunks reach the stream before Finish.
  PickleWriter in_memory;
  WriteDicts(&in_memory, 200000);
  const std::string expected = in_memory.Finish();
  ASSERT_GT(expected.size(), 2 * PickleWriter::kChunkBytes);

  std::ostringstream sink;
  PickleWriter streaming(&sink);
  WriteDicts(&streaming, 200000);
  // Chunks were handed over while writing: what the stream holds is a prefix, whole chunks.
  const size_t before_finish = sink.str().size();
  EXPECT_GE(before_finish, 2 * PickleWriter::kChunkBytes);
  EXPECT_EQ(sink.str(), expected.substr(0, before_finish));
  EXPECT_EQ(streaming.Finish(), "");
  EXPECT_EQ(sink.str(), expected);
  // 199999 = 7 * 28571 + 2.
  EXPECT_EQ(PythonReads(expected, "len(v), v[0], v[199999]"),
            "200000 {'key': 0, 'name': 'n0'} {'key': 199999, 'name': 'n2'}");
}

TEST(PickleWriter, LiteralsAndStringHandlesWriteWhatStringWrites) {
  PickleWriter by_value;
  by_value.BeginList();
  for (int i = 0; i < 3; ++i) {
    by_value.String("k");
    by_value.String("v");
  }
  by_value.EndList();

  PickleWriter by_handle;
  by_handle.BeginList();
  by_handle.Literal("k");
  const int64_t v = by_handle.StringHandle("v");
  for (int i = 0; i < 2; ++i) {
    by_handle.Literal("k");
    by_handle.Reference(v);
  }
  by_handle.EndList();
  const std::string bytes = by_handle.Finish();
  EXPECT_EQ(bytes, by_value.Finish());
  EXPECT_EQ(PythonReads(bytes, "v"), "['k', 'v', 'k', 'v', 'k', 'v']");
}

}  // namespace
}  // namespace memsim
