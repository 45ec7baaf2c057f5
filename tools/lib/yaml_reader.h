// Strict YAML reading shared by run files, presets and validation cases: every error
// names the file and line, unknown keys are errors.
#pragma once

#include <yaml-cpp/yaml.h>

#include <functional>
#include <map>
#include <string>

#include "simulator/status.h"

namespace memsim {

// "FILE:LINE" of `node`, for messages.
std::string Where(const std::string& source, const YAML::Node& node);

// Converts `node` to T; a value of the wrong type is an error naming `key`.
template <typename T>
Status Read(const YAML::Node& node, const std::string& source, const std::string& key, T* out) {
  try {
    *out = node.as<T>();
    return Status::OK();
  } catch (const YAML::Exception&) {
    return Status::Error(Where(source, node) + ": '" + key + "' has a value of the wrong type ('" +
                         node.as<std::string>("?") + "')");
  }
}

// `node` is a mapping whose keys are plain scalars, each given once (YAML parsers keep
// the last of repeated keys; memsim refuses them, naming both lines).
Status CheckKeys(const YAML::Node& node, const std::string& source, const std::string& what);

// Applies each key of the mapping `node` with the handler of the same name; unknown keys
// are errors listing the known ones. `what` names the mapping in messages.
using YamlKeyHandler = std::function<Status(const YAML::Node&)>;
Status ApplyKeys(const YAML::Node& node, const std::string& source, const std::string& what,
                 const std::map<std::string, YamlKeyHandler>& handlers);

// Parses the file at `path`; a missing file or malformed YAML is a one-line error.
Status LoadYamlFile(const std::string& path, YAML::Node* out);

}  // namespace memsim
