#pragma once

// A communicator's identity: 16 random bytes chosen at creation (or derived from the
// parent's for sub-communicators). It routes fd hand-offs and names the shared segment.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace loom {

using CommId = std::array<uint8_t, 16>;

/// The job secret: 16 random bytes rank 0 draws and shares through the store. Only its
/// holders may join a communicator (locally or over the network).
using JobSecret = std::array<uint8_t, 16>;

/// Lower-case hex of the first `bytes` bytes, for messages.
inline std::string toHex(const CommId& id, size_t bytes = 16) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < bytes && i < id.size(); ++i) {
    s += kDigits[id[i] >> 4];
    s += kDigits[id[i] & 15];
  }
  return s;
}

/// A child id: a keyed mix of the parent id and `salt` (FNV-1a over both, widened to 128
/// bits with two seeds). Deterministic, so every member derives the same id alone.
inline CommId deriveId(const CommId& parent, std::string_view salt) {
  CommId out{};
  for (int half = 0; half < 2; ++half) {
    uint64_t h = half == 0 ? 0xcbf29ce484222325ULL : 0x84222325cbf29ce4ULL;
    auto mix = [&h](uint8_t b) {
      h ^= b;
      h *= 0x100000001b3ULL;
    };
    for (uint8_t b : parent) mix(b);
    mix(static_cast<uint8_t>(half));
    for (char c : salt) mix(static_cast<uint8_t>(c));
    for (int i = 0; i < 8; ++i) out[half * 8 + i] = static_cast<uint8_t>(h >> (8 * i));
  }
  return out;
}

}  // namespace loom
