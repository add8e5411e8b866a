// Encoding and bounds-checked decoding of the hand-off messages.

#include "core/handshake.h"

#include <cstring>

#include "util/bytes.h"

namespace loom::handshake {

std::array<uint8_t, kHelloBytes> encodeHello(const Hello& hello) {
  ByteWriter w;
  w.integer(kHelloMagic);
  w.integer(kVersion);
  w.raw(hello.comm.data(), hello.comm.size());
  w.raw(hello.secret.data(), hello.secret.size());
  w.integer(hello.rank);
  w.integer(hello.pid);
  std::array<uint8_t, kHelloBytes> out{};
  std::memcpy(out.data(), w.bytes().data(), out.size());
  return out;
}

std::optional<Hello> parseHello(std::span<const uint8_t> bytes) {
  if (bytes.size() != kHelloBytes) return std::nullopt;
  ByteReader in(bytes);
  uint64_t magic = 0;
  uint32_t version = 0;
  Hello hello;
  if (!in.integer(&magic) || !in.integer(&version) || magic != kHelloMagic || version != kVersion ||
      !in.raw(hello.comm.data(), hello.comm.size()) ||
      !in.raw(hello.secret.data(), hello.secret.size()) || !in.integer(&hello.rank) ||
      !in.integer(&hello.pid) || hello.rank < 0 || hello.pid < 0) {
    return std::nullopt;
  }
  return hello;
}

std::array<uint8_t, kWelcomeBytes> encodeWelcome(int32_t status, const std::string& reason) {
  ByteWriter w;
  w.integer(kWelcomeMagic);
  w.integer(status);
  std::array<uint8_t, kWelcomeBytes> out{};
  std::memcpy(out.data(), w.bytes().data(), w.bytes().size());
  std::memcpy(out.data() + w.bytes().size(), reason.data(), std::min<size_t>(reason.size(), 199));
  return out;
}

std::optional<std::pair<int32_t, std::string>> parseWelcome(std::span<const uint8_t> bytes) {
  if (bytes.size() != kWelcomeBytes) return std::nullopt;
  ByteReader in(bytes);
  uint64_t magic = 0;
  int32_t status = 0;
  if (!in.integer(&magic) || magic != kWelcomeMagic || !in.integer(&status)) return std::nullopt;
  const char* text = reinterpret_cast<const char*>(bytes.data() + 12);
  return std::make_pair(status, std::string(text, strnlen(text, 199)));
}

bool secretsEqual(const Secret& a, const Secret& b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<uint8_t>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace loom::handshake
