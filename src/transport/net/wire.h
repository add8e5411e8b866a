#pragma once

// The bytes loom puts on a network connection, and the only code that reads bytes a remote
// stranger could send (so it is fuzzed: tests/fuzz/net_wire_fuzzer.cc).
//
// A connection carries one direction of message traffic between two ranks of one
// communicator: its initiator sends, its acceptor receives (and returns flow-control
// credits). Before any frame, the two prove they hold the job secret:
//   initiator -> acceptor: Hello(initiator)
//   acceptor -> initiator: Hello(acceptor), Proof(acceptor)
//   initiator -> acceptor: Proof(initiator)
// (see transport/net/auth.h). Then the initiator sends data frames, each at most one
// receive buffer long, and the acceptor sends credit frames. A message's first frame carries
// its envelope; later frames continue its payload. Either end says goodbye before it closes
// on leaving normally. All integers are little-endian.

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "transport/message_link.h"
#include "util/comm_id.h"

namespace loom::net {

inline constexpr uint64_t kHelloMagic = 0x74656e2d6d6f6f6cULL;  // "loom-net"
inline constexpr uint64_t kProofMagic = 0x666f72702d6d6f6cULL;  // "lom-prof"
// 2: the control links' kDeparted message (core/control_plane.cc), which a build before it
// would read as a malformed message and fail the communicator over. 3: the control links'
// kFailure message carries its culprit after the code.
inline constexpr uint32_t kWireVersion = 3;

using Nonce = std::array<uint8_t, 32>;
using ProofBytes = std::array<uint8_t, 32>;

/// Which end of a connection a party is.
enum class Role : uint32_t {
  kInitiator = 1,  ///< connected, sends the data
  kAcceptor = 2,   ///< accepted, receives the data
};

/// Who a party is and the fresh nonce it contributes to the proofs.
struct Hello {
  Role role = Role::kInitiator;
  CommId comm{};
  int32_t sender = 0;    ///< the rank whose data the connection carries
  int32_t receiver = 0;  ///< the rank that receives it
  uint32_t channel = 0;  ///< which of the pair's connections (point-to-point, collectives)
  Nonce nonce{};
  bool operator==(const Hello&) const = default;
};
inline constexpr size_t kHelloBytes = 8 + 4 + 4 + 16 + 4 + 4 + 4 + 32;
inline constexpr size_t kProofBytes = 8 + 32;

std::array<uint8_t, kHelloBytes> encodeHello(const Hello& hello);
/// Decodes a Hello; nullopt unless `bytes` is exactly a well-formed Hello of this version.
std::optional<Hello> parseHello(std::span<const uint8_t> bytes);

// Every build's Hello opens with the magic and its wire version, so builds that differ can
// tell each other so: an acceptor that gets a Hello of another version answers with a
// version note (those two fields alone) and closes, and its initiator names both versions.
inline constexpr size_t kVersionNoteBytes = 8 + 4;
std::array<uint8_t, kVersionNoteBytes> encodeVersionNote();
/// The wire version that `bytes` declare if they open as a loom Hello or a version note do
/// (any build's), else nullopt.
std::optional<uint32_t> declaredVersion(std::span<const uint8_t> bytes);
std::array<uint8_t, kProofBytes> encodeProof(const ProofBytes& proof);
/// Decodes a Proof; nullopt unless `bytes` is exactly one.
std::optional<ProofBytes> parseProof(std::span<const uint8_t> bytes);

/// What a frame is.
enum class FrameType : uint8_t {
  kData = 1,     ///< initiator -> acceptor: payload bytes, the first frame of a message
                 ///< also its envelope
  kCredit = 2,   ///< acceptor -> initiator: `credits` more frames may be sent
  kGoodbye = 3,  ///< either way: this end destroyed its communicator normally; the
                 ///< connection's closing that follows is no failure
};

/// The fixed header in front of every frame.
struct FrameHeader {
  FrameType type = FrameType::kData;
  bool first = false;    ///< data: starts a message (`envelope` is meaningful)
  uint32_t credits = 0;  ///< credit: how many receive buffers were freed
  uint32_t length = 0;   ///< data: payload bytes in this frame
  Envelope envelope;     ///< data, first frame only: the message's tag, total size and stamp
};
inline constexpr size_t kFrameHeaderBytes = 32;

/// Writes `header` into exactly kFrameHeaderBytes at `out`.
void encodeFrameHeader(const FrameHeader& header, uint8_t* out);
/// Decodes the header at the start of a received frame of `bytes.size()` bytes; nullopt
/// unless it is well formed and its length matches the frame's.
std::optional<FrameHeader> parseFrameHeader(std::span<const uint8_t> bytes);

/// Checks that a sequence of data frames forms whole messages: a continuation only inside
/// a message, a first frame only between messages, never more payload than announced.
class MessageStream {
 public:
  /// Accepts the next data frame's header, or returns why it cannot follow.
  std::optional<std::string> accept(const FrameHeader& header);
  /// Payload bytes of the current message still to come.
  uint64_t remaining() const { return remaining_; }
  /// True between messages.
  bool idle() const { return !inMessage_; }

 private:
  bool inMessage_ = false;
  uint64_t remaining_ = 0;
};

}  // namespace loom::net
