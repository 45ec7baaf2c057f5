// Human-readable numbers for messages and reports.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace memsim {

// "1.50 GiB", "512.0 MiB", "-3.20 GiB", "640 B".
inline std::string FormatBytes(int64_t bytes) {
  const double abs = static_cast<double>(bytes < 0 ? -bytes : bytes);
  char buf[32];
  if (abs >= (1ll << 30)) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(bytes) / (1ll << 30));
  } else if (abs >= (1ll << 20)) {
    std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(bytes) / (1ll << 20));
  } else if (abs >= 1024) {
    std::snprintf(buf, sizeof(buf), "%.1f KiB", static_cast<double>(bytes) / 1024);
  } else {
    std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(bytes));
  }
  return buf;
}

// A number as %g prints it ("1.5", "2").
inline std::string FormatNumber(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", v);
  return text;
}

// `text` as one CSV field: in double quotes, each quote inside doubled.
inline std::string CsvQuoted(const std::string& text) {
  std::string quoted = "\"";
  for (char c : text) {
    if (c == '"') quoted += '"';
    quoted += c;
  }
  return quoted + "\"";
}

}  // namespace memsim
