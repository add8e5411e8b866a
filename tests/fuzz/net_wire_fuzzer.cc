// Fuzzes what a remote stranger can send to a network connection: the handshake messages
// and a stream of frames (the input is cut into frames by 2-byte length prefixes), and what
// a proven peer can send in the tensor store's byte fetch (fetch_wire.h). Nothing may read
// out of bounds; an accepted Hello, Proof, frame header or fetch message re-encodes to
// exactly its bytes, the message stream never lets a frame carry more than its message has
// left, and an accepted request's ranges ascend without overlapping or wrapping.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "transport/net/fetch_wire.h"
#include "transport/net/wire.h"

namespace net = loom::net;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  if (const auto hello = net::parseHello(bytes)) {
    const auto encoded = net::encodeHello(*hello);
    if (std::memcmp(encoded.data(), data, size) != 0) std::abort();
  }
  if (const auto proof = net::parseProof(bytes)) {
    if (std::memcmp(net::encodeProof(*proof).data(), data, size) != 0) std::abort();
  }
  const auto same = [&](const std::vector<uint8_t>& encoded) {
    if (encoded.size() != size || std::memcmp(encoded.data(), data, size) != 0) std::abort();
  };
  if (const auto intro = net::parseIntroduction(bytes)) same(net::encodeIntroduction(*intro));
  if (const auto reply = net::parseReply(bytes)) same(net::encodeReply(*reply));
  if (const auto trailer = net::parseTrailer(bytes)) same(net::encodeTrailer(*trailer));
  if (const auto request = net::parseRequest(bytes)) {
    same(net::encodeRequest(*request));
    uint64_t end = 0;
    for (const net::ByteRange& r : request->ranges) {
      if (r.length == 0 || r.offset < end || r.offset + r.length < r.offset) std::abort();
      end = r.offset + r.length;
    }
  }
  net::MessageStream stream;
  size_t at = 0;
  while (at + 2 <= size) {
    const size_t length = data[at] | (size_t{data[at + 1]} << 8);
    at += 2;
    const auto frame = bytes.subspan(at, std::min(length, size - at));
    at += frame.size();
    const auto header = net::parseFrameHeader(frame);
    if (!header) continue;
    uint8_t encoded[net::kFrameHeaderBytes];
    net::encodeFrameHeader(*header, encoded);
    if (std::memcmp(encoded, frame.data(), sizeof encoded) != 0) std::abort();
    if (header->type == net::FrameType::kData &&
        frame.size() != net::kFrameHeaderBytes + header->length) {
      std::abort();
    }
    const uint64_t before = stream.remaining();
    const bool wasIdle = stream.idle();
    if (stream.accept(*header)) {
      if (stream.remaining() != before || stream.idle() != wasIdle) std::abort();  // unchanged
    } else if (!header->first && stream.remaining() + header->length != before) {
      std::abort();
    }
    if (stream.idle() != (stream.remaining() == 0)) std::abort();
  }
  return 0;
}
