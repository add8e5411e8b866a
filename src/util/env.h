#pragma once

// Reading LOOM_* environment variables with validation: a malformed value is an error that
// names the variable and what it accepts, never a silent fallback.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace loom::env {

/// The variable's value, or nullopt if unset or empty.
std::optional<std::string> text(const char* name);

/// An integer in [min, max], or `fallback` if unset.
int64_t integer(const char* name, int64_t fallback, int64_t min, int64_t max);

/// A switch: 1, true, yes, on (any case) or 0, false, no, off; false if unset.
bool flag(const char* name);

/// A byte count with an optional K, M or G suffix (powers of 1024), in [min, max].
size_t bytes(const char* name, size_t fallback, size_t min, size_t max);

/// Parses "123", "64K", "1M", "2G"; nullopt if malformed or overflowing.
std::optional<uint64_t> parseBytes(const std::string& s);

}  // namespace loom::env
