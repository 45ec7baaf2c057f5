#include "simulator/pickle_writer.h"

#include <limits>

#include "simulator/check.h"

namespace memsim {
namespace {

// The opcodes of pickle protocol 2 this writer uses (Python's Lib/pickle.py).
constexpr char kProto = '\x80';
constexpr char kStop = '.';
constexpr char kMark = '(';
constexpr char kBinInt1 = 'K';   // 1-byte unsigned
constexpr char kBinInt2 = 'M';   // 2-byte unsigned little-endian
constexpr char kBinInt = 'J';    // 4-byte signed little-endian
constexpr char kLong1 = '\x8a';  // 1-byte length, then little-endian two's complement
constexpr char kNewTrue = '\x88';
constexpr char kNewFalse = '\x89';
constexpr char kBinUnicode = 'X';  // 4-byte length, then UTF-8
constexpr char kTuple2 = '\x86';
constexpr char kEmptyList = ']';
constexpr char kAppends = 'e';
constexpr char kEmptyDict = '}';
constexpr char kSetItems = 'u';
constexpr char kBinPut = 'q';  // 1-byte memo index
constexpr char kLongBinPut = 'r';
constexpr char kBinGet = 'h';
constexpr char kLongBinGet = 'j';

}  // namespace

PickleWriter::PickleWriter(std::ostream* sink) : sink_(sink) { WriteHeader(); }

void PickleWriter::Flush() {
  sink_->write(out_.data(), static_cast<std::streamsize>(out_.size()));
  out_.clear();
}

void PickleWriter::WriteHeader() {
  Opcode(kProto);
  out_.push_back('\x02');
}

void PickleWriter::BeforeValue() {
  FlushIfChunk();
  if (!open_has_items_.empty() && !open_has_items_.back()) {
    Opcode(kMark);
    open_has_items_.back() = true;
  }
}

void PickleWriter::Uint32(uint32_t value) {
  const char bytes[4] = {static_cast<char>(value & 0xff), static_cast<char>((value >> 8) & 0xff),
                         static_cast<char>((value >> 16) & 0xff),
                         static_cast<char>((value >> 24) & 0xff)};
  out_.append(bytes, 4);
}

void PickleWriter::Int(int64_t value) {
  BeforeValue();
  // The shortest encoding, as Python's pickler chooses it.
  if (0 <= value && value < 256) {
    Opcode(kBinInt1);
    out_.push_back(static_cast<char>(value));
  } else if (0 <= value && value < 65536) {
    Opcode(kBinInt2);
    out_.push_back(static_cast<char>(value & 0xff));
    out_.push_back(static_cast<char>(value >> 8));
  } else if (value >= std::numeric_limits<int32_t>::min() &&
             value <= std::numeric_limits<int32_t>::max()) {
    Opcode(kBinInt);
    Uint32(static_cast<uint32_t>(static_cast<int32_t>(value)));
  } else {
    // Two's complement, little-endian, in as few bytes as keep the sign (5 to 8 here).
    int bytes = 8;
    while (bytes > 5) {
      const int shift = 8 * (bytes - 1) - 1;  // the sign bit of a (bytes-1)-byte number
      const int64_t top = value >> shift;     // arithmetic: all 0 or all 1 when it fits
      if (top != 0 && top != -1) break;
      --bytes;
    }
    Opcode(kLong1);
    out_.push_back(static_cast<char>(bytes));
    const uint64_t bits = static_cast<uint64_t>(value);
    for (int i = 0; i < bytes; ++i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  }
}

void PickleWriter::Bool(bool value) {
  BeforeValue();
  Opcode(value ? kNewTrue : kNewFalse);
}

void PickleWriter::String(std::string_view value) { StringHandle(value); }

int64_t PickleWriter::StringHandle(std::string_view value) {
  auto it = string_handles_.find(value);
  if (it != string_handles_.end()) {
    Reference(it->second);
    return it->second;
  }
  BeforeValue();
  MEMSIM_DCHECK(value.size() <= std::numeric_limits<uint32_t>::max());
  Opcode(kBinUnicode);
  Uint32(static_cast<uint32_t>(value.size()));
  out_.append(value.data(), value.size());
  const int64_t handle = Remember();
  string_handles_.emplace(string_storage_.emplace_back(value), handle);
  return handle;
}

void PickleWriter::Literal(const char* text) {
  // Fibonacci hashing: the address times 2^64 / phi, its top 6 bits (64 slots).
  static_assert(std::tuple_size<decltype(recent_literals_)>::value == 64);
  LiteralSlot& slot = recent_literals_[(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(text)) *
                                        0x9E3779B97F4A7C15ULL) >>
                                       58];
  if (slot.text == text) {
    Reference(slot.handle);
    return;
  }
  auto [it, added] = literal_handles_.try_emplace(text, -1);
  if (added) {
    it->second = StringHandle(text);
  } else {
    Reference(it->second);
  }
  slot = {text, it->second};
}

void PickleWriter::Pair(int64_t first, int64_t second) {
  BeforeValue();
  // The items go on the stack above the container's MARK, so they need no MARK of their own.
  open_has_items_.push_back(true);
  Int(first);
  Int(second);
  open_has_items_.pop_back();
  Opcode(kTuple2);
}

void PickleWriter::Open(char empty_container) {
  BeforeValue();
  Opcode(empty_container);
  open_has_items_.push_back(false);
}

void PickleWriter::Close(char add_items) {
  MEMSIM_DCHECK(!open_has_items_.empty());
  if (open_has_items_.back()) Opcode(add_items);
  open_has_items_.pop_back();
}

void PickleWriter::BeginList() { Open(kEmptyList); }
void PickleWriter::EndList() { Close(kAppends); }
void PickleWriter::BeginDict() { Open(kEmptyDict); }
void PickleWriter::EndDict() { Close(kSetItems); }

int64_t PickleWriter::Remember() {
  const int64_t handle = next_handle_++;
  MEMSIM_DCHECK(handle <= std::numeric_limits<uint32_t>::max());
  if (handle < 256) {
    Opcode(kBinPut);
    out_.push_back(static_cast<char>(handle));
  } else {
    Opcode(kLongBinPut);
    Uint32(static_cast<uint32_t>(handle));
  }
  return handle;
}

void PickleWriter::Reference(int64_t handle) {
  MEMSIM_DCHECK(0 <= handle && handle < next_handle_);
  BeforeValue();
  if (handle < 256) {
    Opcode(kBinGet);
    out_.push_back(static_cast<char>(handle));
  } else {
    Opcode(kLongBinGet);
    Uint32(static_cast<uint32_t>(handle));
  }
}

std::string PickleWriter::Finish() {
  MEMSIM_DCHECK(open_has_items_.empty());
  Opcode(kStop);
  if (sink_ != nullptr) Flush();
  std::string out = std::move(out_);
  out_.clear();
  string_handles_.clear();
  literal_handles_.clear();
  recent_literals_.fill(LiteralSlot());
  string_storage_.clear();
  next_handle_ = 0;
  WriteHeader();
  return out;
}

}  // namespace memsim
