#include "tools/lib/yaml_reader.h"

#include <yaml-cpp/depthguard.h>

#include <filesystem>

namespace memsim {
namespace fs = std::filesystem;

std::string Where(const std::string& source, const YAML::Node& node) {
  return source + ":" + std::to_string(node.Mark().line + 1);
}

Status CheckKeys(const YAML::Node& node, const std::string& source, const std::string& what) {
  if (!node.IsMap()) return Status::Error(Where(source, node) + ": " + what + " must be a mapping");
  std::map<std::string, int> first_line;
  for (const auto& entry : node) {
    if (!entry.first.IsScalar()) {
      return Status::Error(Where(source, entry.first) + ": keys in " + what +
                           " must be plain names");
    }
    const int line = entry.first.Mark().line + 1;
    if (auto [it, fresh] = first_line.emplace(entry.first.Scalar(), line); !fresh) {
      return Status::Error(source + ":" + std::to_string(line) + ": '" + entry.first.Scalar() +
                           "' given twice in " + what + " (first at line " +
                           std::to_string(it->second) + ")");
    }
  }
  return Status::OK();
}

Status ApplyKeys(const YAML::Node& node, const std::string& source, const std::string& what,
                 const std::map<std::string, YamlKeyHandler>& handlers) {
  MEMSIM_RETURN_IF_ERROR(CheckKeys(node, source, what));
  for (const auto& entry : node) {
    const std::string key = entry.first.Scalar();
    auto it = handlers.find(key);
    if (it == handlers.end()) {
      std::string known;
      for (const auto& [name, _] : handlers) known += (known.empty() ? "" : ", ") + name;
      return Status::Error(Where(source, entry.first) + ": unknown key '" + key + "' in " + what +
                           " (known: " + known + ")");
    }
    MEMSIM_RETURN_IF_ERROR(it->second(entry.second));
  }
  return Status::OK();
}

Status LoadYamlFile(const std::string& path, YAML::Node* out) {
  std::error_code ec;  // the throwing overload fails on names the OS rejects
  if (!fs::is_regular_file(path, ec)) {
    return Status::Error("cannot read '" + path + "': no such file");
  }
  try {
    *out = YAML::LoadFile(path);
  } catch (const YAML::DeepRecursion& e) {
    return Status::Error(path + ":" + std::to_string(e.mark.line + 1) + ": YAML nested more than " +
                         std::to_string(e.depth()) +
                         " levels deep; no memsim file nests more than a few");
  } catch (const YAML::ParserException& e) {
    return Status::Error(path + ":" + std::to_string(e.mark.line + 1) +
                         ": malformed YAML: " + e.msg);
  } catch (const YAML::Exception& e) {
    return Status::Error("cannot read '" + path + "': " + e.what());
  }
  return Status::OK();
}

}  // namespace memsim
