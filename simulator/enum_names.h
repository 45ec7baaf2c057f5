// EnumName tables: each enum's string names written once, beside the enum, and used for
// printing and parsing alike.
//
// Note [Enum names]
// A table lists every value of an enum with its name as files, the command line and the
// outputs spell it. The first entry of a value is its name when printed; later entries
// for the same value are aliases that parsing also accepts ("zero1" for
// "distributed-optimizer"). Printing a value missing from its table is a programming
// error (MEMSIM_DCHECK); parsing an unknown name is a user error naming every choice.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "simulator/check.h"
#include "simulator/status.h"

namespace memsim {

template <typename E>
struct EnumName {
  E value;
  std::string_view name;
};

// The printed name of `value`.
template <typename E, size_t N>
std::string_view NameOf(const EnumName<E> (&table)[N], E value) {
  for (const EnumName<E>& entry : table) {
    if (entry.value == value) return entry.name;
  }
  MEMSIM_DCHECK(false && "value missing from its EnumName table");
  return "?";
}

// The printed name of every value, in the table's order (aliases left out): what outputs
// export so that other tools (tools/plots) need no copy of the names.
template <typename E, size_t N>
std::vector<std::string> PrintedNames(const EnumName<E> (&table)[N]) {
  std::vector<std::string> names;
  for (size_t i = 0; i < N; ++i) {
    if (NameOf(table, table[i].value) == table[i].name) names.emplace_back(table[i].name);
  }
  return names;
}

// Every name the table accepts (aliases included), in alphabetical order, comma-separated.
template <typename E, size_t N>
std::string AcceptedNames(const EnumName<E> (&table)[N]) {
  std::vector<std::string_view> names;
  for (const EnumName<E>& entry : table) names.push_back(entry.name);
  std::sort(names.begin(), names.end());
  std::string list;
  for (std::string_view name : names) {
    if (!list.empty()) list += ", ";
    list += name;
  }
  return list;
}

// Sets `*out` to the value named `text`; otherwise "unknown <what> 'text' (use one of: ...)".
template <typename E, size_t N>
Status ParseEnum(const EnumName<E> (&table)[N], const std::string& text, const char* what, E* out) {
  for (const EnumName<E>& entry : table) {
    if (entry.name == text) {
      *out = entry.value;
      return Status::OK();
    }
  }
  return Status::Error("unknown " + std::string(what) + " '" + text +
                       "' (use one of: " + AcceptedNames(table) + ")");
}

}  // namespace memsim
