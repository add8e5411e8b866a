// Fuzzes the segment hand-off messages: parseHello reads what any local process may send
// to a leader's socket, parseWelcome what a member reads back. Neither may read out of
// bounds; an accepted Hello re-encodes to exactly the same bytes, and an accepted Welcome
// survives an encode/parse round trip.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "core/handshake.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace hs = loom::handshake;
  const std::span<const uint8_t> bytes(data, size);
  if (const auto hello = hs::parseHello(bytes)) {
    const auto encoded = hs::encodeHello(*hello);
    if (size != encoded.size() || std::memcmp(encoded.data(), data, size) != 0) std::abort();
    if (hello->rank < 0 || hello->pid < 0) std::abort();
  }
  if (const auto welcome = hs::parseWelcome(bytes)) {
    if (welcome->second.size() > 199) std::abort();
    const auto encoded = hs::encodeWelcome(welcome->first, welcome->second);
    const auto again = hs::parseWelcome(encoded);
    if (!again || *again != *welcome) std::abort();
  }
  return 0;
}
