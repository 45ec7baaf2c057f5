// PickleWriter: writes a Python pickle (protocol 2) of dicts, lists, strings, ints, bools
// and pairs value by value, as Python's pickle.load reads it, into a byte string or a stream.
//
// Note [Streaming pickle]
// Snapshots hold a dict per trace entry and per frame: millions of them for a long run.
// Built as LibTorch IValues (c10::Dict) and handed to torch::jit::Pickler, building,
// hashing and destroying those dicts took two thirds of a simulate run and most of its
// memory. This writer emits each value's opcodes as the caller walks its own data, so
// nothing but the output bytes is kept. It also frees the snapshot writer from the JIT
// pickler, an internal LibTorch header. Strings are memoized by value (each distinct
// string is written once, then referenced), so repeated keys and names cost a few bytes.
// Given a stream, the writer hands it the bytes in chunks as they are written, so not
// even the output is kept: the snapshot of a 512-microbatch run's last iteration is
// 84 MB a rank, and one held whole per rank class was most of a run's memory.
//
// Usage: containers are opened and closed in nesting order; inside a dict, values
// alternate key, value. The writer does not check the nesting: Finish() REQUIRES every
// container closed.
//
//   PickleWriter w;
//   w.BeginDict(); w.String("a"); w.Int(1); w.EndDict();   // {"a": 1}
//   std::string bytes = w.Finish();
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <ostream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace memsim {

class PickleWriter {
 public:
  // Writes the protocol header. With a `sink`, bytes go to it about every kChunkBytes and
  // at Finish(); the sink must outlive the writer, and its state tells of write errors.
  explicit PickleWriter(std::ostream* sink = nullptr);
  PickleWriter(const PickleWriter&) = delete;
  PickleWriter& operator=(const PickleWriter&) = delete;

  void Int(int64_t value);
  void Bool(bool value);
  void String(std::string_view value);  // UTF-8; memoized by value
  // String(value), returning its handle: Reference(handle) writes it again without hashing
  // it (until Finish).
  int64_t StringHandle(std::string_view value);
  // String(text) for a string with static storage (a literal): remembered by its address,
  // so writing it again hashes a pointer, not its characters.
  // REQUIRES: `text` lives, unchanged, as long as the writer.
  void Literal(const char* text);
  void Pair(int64_t first, int64_t second);  // a 2-tuple of ints

  // An empty container is pushed; the values written until its End* become its items.
  void BeginList();
  void EndList();
  void BeginDict();
  void EndDict();

  // Remembers the value just begun or written (a list right after BeginList, for
  // example) and returns its handle; Reference(handle) writes that same object again
  // (Python gets one shared object, as when a list is referenced twice).
  // REQUIRES: fewer than 2^32 values remembered (pickle's memo indices are 32-bit;
  // strings count too); strings shorter than 4 GiB.
  int64_t Remember();
  void Reference(int64_t handle);

  // Ends the pickle. Without a sink, returns it; with one, hands the sink the rest and
  // returns an empty string. The writer starts a fresh pickle afterwards.
  // REQUIRES: every container opened was closed.
  std::string Finish();

  static constexpr size_t kChunkBytes = size_t{1} << 20;

 private:
  void WriteHeader();  // the protocol opcode every pickle starts with
  // Writes the MARK that opens the enclosing container's items before its first one.
  void BeforeValue();
  // Hands the sink what was written, once it is a chunk.
  void FlushIfChunk() {
    if (sink_ != nullptr && out_.size() >= kChunkBytes) Flush();
  }
  void Flush();
  // Pushes an empty container (its opcode); Close adds the items written since, if any.
  void Open(char empty_container);
  void Close(char add_items);
  void Opcode(char op) { out_.push_back(op); }
  void Uint32(uint32_t value);

  std::ostream* sink_;  // null: out_ keeps every byte until Finish
  std::string out_;
  int64_t next_handle_ = 0;
  // Keys view the strings kept in string_storage_ (a deque: its elements never move), so
  // a lookup constructs no string.
  std::deque<std::string> string_storage_;
  std::unordered_map<std::string_view, int64_t> string_handles_;
  std::unordered_map<const char*, int64_t> literal_handles_;  // Literal's, by address
  // In front of literal_handles_, by address: a snapshot asks for a few dozen literals,
  // millions of times, and a hash lookup each time was a twentieth of a simulate run.
  struct LiteralSlot {
    const char* text = nullptr;
    int64_t handle = -1;
  };
  std::array<LiteralSlot, 64> recent_literals_;
  // Per open container: whether it holds an item yet (a MARK is written before the
  // first one, so an empty container stays a bare EMPTY_LIST / EMPTY_DICT).
  std::vector<bool> open_has_items_;
};

}  // namespace memsim
