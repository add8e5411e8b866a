#pragma once

// The two messages of the segment hand-off between a communicator's leader and a member,
// over a Unix socket whose peer uid the leader has already checked (SO_PEERCRED):
//   member -> leader: Hello   (which communicator, which rank, the job secret, its pid)
//   leader -> member: Welcome (accepted or why not), with the memfd attached (SCM_RIGHTS)
// Both are fixed-size and little-endian. parseHello is the only code that reads bytes a
// local stranger could send, so it is fuzzed.

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "util/comm_id.h"

namespace loom::handshake {

using Secret = JobSecret;

inline constexpr uint64_t kHelloMagic = 0x6f6c65682d6d6f6fULL;    // "oom-helo"
inline constexpr uint64_t kWelcomeMagic = 0x656d6c772d6d6f6fULL;  // "oom-wlme"
inline constexpr uint32_t kVersion = 1;
inline constexpr size_t kHelloBytes = 8 + 4 + 16 + 16 + 4 + 4;
inline constexpr size_t kWelcomeBytes = 8 + 4 + 200;

struct Hello {
  CommId comm{};
  Secret secret{};
  int32_t rank = 0;
  int32_t pid = 0;
};

/// Serialises a Hello into exactly kHelloBytes.
std::array<uint8_t, kHelloBytes> encodeHello(const Hello& hello);
/// Decodes a Hello; nullopt unless `bytes` is exactly a well-formed Hello of this version.
std::optional<Hello> parseHello(std::span<const uint8_t> bytes);

/// A Welcome's status for members of a communicator whose leader gave up making it
/// (ProcessService::abandon); its reason says why. (1 and 2 are fd_exchange's.)
inline constexpr int32_t kAbandoned = 3;

/// Serialises a Welcome: status 0 = accepted, otherwise `reason` says why not.
std::array<uint8_t, kWelcomeBytes> encodeWelcome(int32_t status, const std::string& reason);
/// Decodes a Welcome into (status, reason); nullopt if malformed.
std::optional<std::pair<int32_t, std::string>> parseWelcome(std::span<const uint8_t> bytes);

/// Constant-time comparison, so a prober learns nothing from timing.
bool secretsEqual(const Secret& a, const Secret& b);

}  // namespace loom::handshake
