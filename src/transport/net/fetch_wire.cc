// Encoding and bounds-checked decoding of the byte-fetch protocol.

#include "transport/net/fetch_wire.h"

#include <algorithm>

#include "util/bytes.h"

namespace loom::net {

namespace {

constexpr uint32_t kFetchMagic = 0x68637466;  // "ftch"

bool knownState(uint8_t s) {
  return s <= static_cast<uint8_t>(SourceState::kUnknown);
}

}  // namespace

std::vector<uint8_t> encodeIntroduction(const FetchIntroduction& intro) {
  ByteWriter w;
  w.integer(kFetchMagic);
  w.string(intro.address);
  w.integer(intro.replyChannel);
  return std::move(w.bytes());
}

std::optional<FetchIntroduction> parseIntroduction(std::span<const uint8_t> bytes) {
  ByteReader in(bytes);
  uint32_t magic = 0;
  FetchIntroduction intro;
  if (!in.integer(&magic) || magic != kFetchMagic || !in.string(&intro.address, kMaxAddressBytes) ||
      intro.address.empty() || !in.integer(&intro.replyChannel) ||
      isRequestChannel(intro.replyChannel) || !in.atEnd()) {
    return std::nullopt;
  }
  return intro;
}

std::vector<uint8_t> encodeRequest(const FetchRequest& request) {
  ByteWriter w;
  w.integer(request.sequence);
  w.raw(request.source.data(), request.source.size());
  w.integer(request.generation);
  w.integer(static_cast<uint32_t>(request.ranges.size()));
  for (const ByteRange& r : request.ranges) {
    w.integer(r.offset);
    w.integer(r.length);
  }
  return std::move(w.bytes());
}

std::optional<FetchRequest> parseRequest(std::span<const uint8_t> bytes) {
  ByteReader in(bytes);
  FetchRequest request;
  uint32_t count = 0;
  if (!in.integer(&request.sequence) || !in.raw(request.source.data(), request.source.size()) ||
      !in.integer(&request.generation) || !in.integer(&count) || count == 0 || count > kMaxRanges ||
      in.remaining() != size_t{count} * 16) {
    return std::nullopt;
  }
  request.ranges.resize(count);
  uint64_t end = 0;  // where the previous range ended
  for (uint32_t i = 0; i < count; ++i) {
    ByteRange& r = request.ranges[i];
    if (!in.integer(&r.offset) || !in.integer(&r.length)) return std::nullopt;
    if (r.length == 0 || r.offset > UINT64_MAX - r.length || (i > 0 && r.offset < end)) {
      return std::nullopt;
    }
    end = r.offset + r.length;
  }
  return request;
}

std::vector<uint8_t> encodeReply(const FetchReply& reply) {
  ByteWriter w;
  w.integer(reply.sequence);
  w.integer(static_cast<uint8_t>(reply.state));
  w.integer(reply.generation);
  w.integer(reply.progress);
  return std::move(w.bytes());
}

std::optional<FetchReply> parseReply(std::span<const uint8_t> bytes) {
  ByteReader in(bytes);
  FetchReply reply;
  uint8_t state = 0;
  if (!in.integer(&reply.sequence) || !in.integer(&state) || !knownState(state) ||
      !in.integer(&reply.generation) || !in.integer(&reply.progress) || !in.atEnd()) {
    return std::nullopt;
  }
  reply.state = static_cast<SourceState>(state);
  return reply;
}

std::vector<uint8_t> encodeTrailer(const FetchTrailer& trailer) {
  ByteWriter w;
  w.integer(trailer.sequence);
  w.integer(static_cast<uint8_t>(trailer.unchanged ? 1 : 0));
  return std::move(w.bytes());
}

std::optional<FetchTrailer> parseTrailer(std::span<const uint8_t> bytes) {
  ByteReader in(bytes);
  FetchTrailer trailer;
  uint8_t unchanged = 0;
  if (!in.integer(&trailer.sequence) || !in.integer(&unchanged) || unchanged > 1 || !in.atEnd()) {
    return std::nullopt;
  }
  trailer.unchanged = unchanged == 1;
  return trailer;
}

std::vector<ByteRange> mergedRanges(std::vector<ByteRange> ranges) {
  std::erase_if(ranges, [](const ByteRange& r) { return r.length == 0; });
  std::sort(ranges.begin(), ranges.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.offset < b.offset; });
  std::vector<ByteRange> out;
  for (const ByteRange& r : ranges) {
    if (!out.empty() && r.offset <= out.back().offset + out.back().length) {
      const uint64_t end = std::max(out.back().offset + out.back().length, r.offset + r.length);
      out.back().length = end - out.back().offset;
    } else {
      out.push_back(r);
    }
  }
  return out;
}

}  // namespace loom::net
