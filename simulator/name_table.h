// NameTable: interns strings (op names, module paths) as dense 32-bit ids.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "simulator/check.h"

namespace memsim {

using NameId = int32_t;

// Not thread-safe; each Recorder owns one.
class NameTable {
 public:
  NameTable() { Intern(""); }  // id 0 is the empty name ("none")

  NameId Intern(std::string_view name) {
    auto it = ids_.find(std::string(name));
    if (it != ids_.end()) return it->second;
    const NameId id = static_cast<NameId>(names_.size());
    names_.emplace_back(name);
    ids_.emplace(names_.back(), id);
    return id;
  }
  // REQUIRES: id was returned by Intern.
  const std::string& Name(NameId id) const {
    MEMSIM_DCHECK(id >= 0 && static_cast<size_t>(id) < names_.size());
    return names_[static_cast<size_t>(id)];
  }
  size_t size() const { return names_.size(); }

 private:
  std::vector<std::string> names_;
  std::unordered_map<std::string, NameId> ids_;
};

}  // namespace memsim
