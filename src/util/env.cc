// LOOM_* environment variables.

#include "util/env.h"

#include <cctype>
#include <charconv>
#include <cstdlib>

#include "loom/error.h"

namespace loom::env {

std::optional<std::string> text(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int64_t integer(const char* name, int64_t fallback, int64_t min, int64_t max) {
  const auto v = text(name);
  if (!v) return fallback;
  int64_t value = 0;
  auto [ptr, ec] = std::from_chars(v->data(), v->data() + v->size(), value);
  if (ec != std::errc() || ptr != v->data() + v->size() || value < min || value > max) {
    throw Error(ErrorCode::kInvalidArgument, "config", -1,
                std::string(name) + "=" + *v + " is not an integer in [" + std::to_string(min) +
                    ", " + std::to_string(max) + "]; fix or unset it");
  }
  return value;
}

bool flag(const char* name) {
  const auto v = text(name);
  if (!v) return false;
  std::string lower;
  for (char c : *v) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower == "0" || lower == "false" || lower == "no" || lower == "off") return false;
  throw Error(
      ErrorCode::kInvalidArgument, "config", -1,
      std::string(name) + "=" + *v + " is not a switch: set it to 1 (on) or 0 (off), or unset it");
}

std::optional<uint64_t> parseBytes(const std::string& s) {
  uint64_t value = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || ptr == s.data()) return std::nullopt;
  const std::string suffix(ptr, s.data() + s.size());
  int shift = 0;
  if (suffix.empty() || suffix == "B")
    shift = 0;
  else if (suffix == "K" || suffix == "k" || suffix == "KiB")
    shift = 10;
  else if (suffix == "M" || suffix == "m" || suffix == "MiB")
    shift = 20;
  else if (suffix == "G" || suffix == "g" || suffix == "GiB")
    shift = 30;
  else
    return std::nullopt;
  if (shift > 0 && value > (UINT64_MAX >> shift)) return std::nullopt;
  return value << shift;
}

size_t bytes(const char* name, size_t fallback, size_t min, size_t max) {
  const auto v = text(name);
  if (!v) return fallback;
  const auto value = parseBytes(*v);
  if (!value || *value < min || *value > max) {
    throw Error(ErrorCode::kInvalidArgument, "config", -1,
                std::string(name) + "=" + *v + " is not a size in [" + std::to_string(min) + ", " +
                    std::to_string(max) +
                    "] bytes (a number with an optional K, M or G suffix); fix or unset it");
  }
  return static_cast<size_t>(*value);
}

}  // namespace loom::env
