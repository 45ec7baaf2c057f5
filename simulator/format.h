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

// A count with a decimal scale: "1.32 B", "456.1 M", "12.0 K", "640". REQUIRES: count >= 0.
inline std::string FormatCount(int64_t count) {
  const double value = static_cast<double>(count);
  char buf[32];
  if (count >= 1'000'000'000) {
    std::snprintf(buf, sizeof(buf), "%.2f B", value / 1e9);
  } else if (count >= 1'000'000) {
    std::snprintf(buf, sizeof(buf), "%.1f M", value / 1e6);
  } else if (count >= 1'000) {
    std::snprintf(buf, sizeof(buf), "%.1f K", value / 1e3);
  } else {
    std::snprintf(buf, sizeof(buf), "%lld", static_cast<long long>(count));
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
