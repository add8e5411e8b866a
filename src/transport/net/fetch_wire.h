#pragma once

// The byte-fetch protocol: how a reader on another host copies bytes out of a writer's
// buffers (the tensor store's regions). It rides on two channels of one pair of processes,
// each proving the job secret first (channel.h): the reader's requests on one, the server's
// replies on the other, each message's kind in its envelope's tag.
//   reader -> server: Introduction (once: where the reader listens for the replies)
//   reader -> server: Request (a source, the generation wanted, byte ranges)
//   server -> reader: Reply (the source's state), then if it holds the generation whole:
//                     the ranges' bytes as Data messages in order, then a Trailer saying
//                     whether the source stayed unchanged while they were sent
// The bytes are sent straight from the source, so a Trailer is the sequence lock's second
// look (transport/shm/region.h): a reader keeps the bytes only if it says unchanged. This is
// code that parses what a peer sends (fuzzed: tests/fuzz/net_wire_fuzzer.cc).

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace loom::net {

/// The pair's channels (Hello::channel): a reader's n-th connection to a server sends its
/// requests on channel 2n and takes the replies on 2n + 1, so a channel of a connection given
/// up can never be taken for one of the next.
inline constexpr bool isRequestChannel(uint32_t channel) {
  return channel % 2 == 0;
}

/// What a message is (its envelope's tag).
enum class FetchTag : int {
  kIntroduction = 1,
  kRequest = 2,
  kReply = 3,
  kData = 4,
  kTrailer = 5,
};

/// Names one source of a server (a region's random id).
using SourceId = std::array<uint8_t, 16>;

/// Where a source stands against the generation a request wants (as MappedBuffer.state).
enum class SourceState : uint8_t {
  kWhole = 0,     ///< it holds that generation whole: its bytes follow
  kWriting = 1,   ///< the write that makes it is under way
  kPending = 2,   ///< that write has not begun
  kReplaced = 3,  ///< a later write began: that generation is gone
  kUnknown = 4,   ///< the server has no such source (withdrawn, or never published)
};

/// Bytes [offset, offset + length) of a source.
struct ByteRange {
  uint64_t offset = 0;
  uint64_t length = 0;
  bool operator==(const ByteRange&) const = default;
};

struct FetchIntroduction {
  std::string address;        ///< where the server connects the replies' channel ("ip:port")
  uint32_t replyChannel = 1;  ///< which channel that is (the request channel's number + 1)
  bool operator==(const FetchIntroduction&) const = default;
};

struct FetchRequest {
  uint64_t sequence = 0;  ///< the reader's count, echoed in the reply and trailer
  SourceId source{};
  uint64_t generation = 0;
  std::vector<ByteRange> ranges;  ///< non-empty, ascending, not overlapping, none empty
  bool operator==(const FetchRequest&) const = default;
};

struct FetchReply {
  uint64_t sequence = 0;
  SourceState state = SourceState::kUnknown;
  uint64_t generation = 0;  ///< the source's generation now
  uint64_t progress = 0;    ///< bytes of the write under way (kWriting)
  bool operator==(const FetchReply&) const = default;
};

struct FetchTrailer {
  uint64_t sequence = 0;
  bool unchanged = false;  ///< no write began while the bytes were sent
  bool operator==(const FetchTrailer&) const = default;
};

inline constexpr size_t kMaxAddressBytes = 256;
inline constexpr size_t kMaxRanges = size_t{1} << 16;
/// The longest Request a server reads.
inline constexpr size_t kMaxRequestBytes = 8 + 16 + 8 + 4 + 16 * kMaxRanges;
inline constexpr size_t kReplyBytes = 8 + 1 + 8 + 8;
inline constexpr size_t kTrailerBytes = 8 + 1;

std::vector<uint8_t> encodeIntroduction(const FetchIntroduction& intro);
std::vector<uint8_t> encodeRequest(const FetchRequest& request);
std::vector<uint8_t> encodeReply(const FetchReply& reply);
std::vector<uint8_t> encodeTrailer(const FetchTrailer& trailer);
/// Each decodes exactly one well-formed message of its kind, else nullopt.
std::optional<FetchIntroduction> parseIntroduction(std::span<const uint8_t> bytes);
std::optional<FetchRequest> parseRequest(std::span<const uint8_t> bytes);
std::optional<FetchReply> parseReply(std::span<const uint8_t> bytes);
std::optional<FetchTrailer> parseTrailer(std::span<const uint8_t> bytes);

/// The ranges sorted, with touching or overlapping ones merged and empty ones dropped.
std::vector<ByteRange> mergedRanges(std::vector<ByteRange> ranges);

}  // namespace loom::net
