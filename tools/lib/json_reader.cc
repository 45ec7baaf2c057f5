#include "tools/lib/json_reader.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace memsim {
namespace {

struct TooDeep {};

}  // namespace

Status ParseJsonFile(const std::string& path, nlohmann::json* out) {
  std::error_code ec;  // (the throwing overload fails on names the OS rejects)
  if (!std::filesystem::is_regular_file(path, ec)) {
    return Status::Error("cannot read '" + path + "': no such file");
  }
  std::ifstream in(path);
  if (!in) return Status::Error("cannot read '" + path + "': " + std::strerror(errno));
  std::stringstream text;
  text << in.rdbuf();
  try {
    *out = nlohmann::json::parse(text.str(),
                                 [](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
                                   if (depth > kMaxJsonDepth) throw TooDeep();
                                   return true;
                                 });
  } catch (const TooDeep&) {
    return Status::Error(path + ": JSON nested deeper than " + std::to_string(kMaxJsonDepth) +
                         " levels");
  } catch (const nlohmann::json::parse_error& e) {
    // what() reads "[json.exception.parse_error.101] parse error at line L, column C: ...".
    const std::string what = e.what();
    const size_t tag_end = what.find("] ");
    return Status::Error(path + ": malformed JSON at byte " + std::to_string(e.byte) + ": " +
                         (tag_end == std::string::npos ? what : what.substr(tag_end + 2)));
  } catch (const nlohmann::json::exception& e) {
    // Found by fuzzing: a number too large for a double ("2e2222") is out_of_range.
    const std::string what = e.what();
    const size_t tag_end = what.find("] ");
    return Status::Error(path + ": unusable JSON: " +
                         (tag_end == std::string::npos ? what : what.substr(tag_end + 2)));
  }
  return Status::OK();
}

}  // namespace memsim
