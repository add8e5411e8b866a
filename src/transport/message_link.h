#pragma once

// What the point-to-point engine needs from a transport: an ordered, reliable stream of
// messages between this rank and one peer. The engine (src/core/p2p_engine) owns matching,
// deadlines and requests; a link only moves envelopes and bytes. Shared-memory rings
// implement it within a host (transport/shm/ring_link); a network link plugs in beside
// them for peers on other hosts.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>

namespace loom {

/// The largest message a link carries (16 TiB): an envelope announcing more is a corrupt or
/// hostile stream, never a message to make room for.
inline constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 44;

/// The envelope of one point-to-point message: its tag and its payload's size.
struct Envelope {
  int tag = 0;
  uint64_t bytes = 0;
  /// The collective call a network message belongs to (algorithms/call_stamp.h); 0 outside
  /// collectives. Network links carry it; shared-memory rings (point-to-point only) do not.
  uint64_t stamp = 0;
};

/// Both directions of message traffic with one peer, driven by one thread (the engine's).
class MessageLink {
 public:
  virtual ~MessageLink() = default;

  /// Outbound: hands over as much of the message (`envelope`, then `payload`) as the link
  /// takes now. `done` counts what was handed over before (0 for a new message) and is
  /// advanced; returns true once all of it is, after which `payload` may be reused.
  /// Messages are delivered in the order their first write() began.
  virtual bool write(const Envelope& envelope, const uint8_t* payload, uint64_t& done) = 0;
  /// write() for a caller that keeps `payload` untouched until drained() is true or it has
  /// called abandonSends(): the link may send straight from it instead of copying it.
  virtual bool writeBorrowed(const Envelope& envelope, const uint8_t* payload, uint64_t& done) {
    return write(envelope, payload, done);
  }
  /// writeBorrowed() of a message whose payload is still being produced: only its first
  /// `ready` bytes may be read yet, and nothing beyond them is handed over (a ring that
  /// passes each part on as it arrives). Default: nothing until all of it is ready.
  virtual bool writeBorrowedPrefix(const Envelope& envelope, const uint8_t* payload, uint64_t& done,
                                   uint64_t ready) {
    return ready >= envelope.bytes && writeBorrowed(envelope, payload, done);
  }
  /// Before memory lent through writeBorrowed() goes back to its owner undrained (the
  /// caller's collective failed): makes sure nothing reads it any more. A link that cannot
  /// recall queued sends closes its outbound direction, so use this only where the failure
  /// ends the communicator anyway.
  virtual void abandonSends() noexcept {}

  /// Inbound: the envelope of the next message once it has arrived, else nullopt; its
  /// payload then follows through read(). Throws Error(kInternal) if the stream is corrupt.
  /// Every call may throw Error(kPeerFailure) once the link to the peer is broken.
  virtual std::optional<Envelope> nextEnvelope() = 0;
  /// Inbound: moves up to `n` bytes of the current message's payload to `dst` (nullptr
  /// discards them) and returns how many.
  virtual size_t read(void* dst, size_t n) = 0;
  /// Inbound: up to `n` of the current message's next bytes where they lie in the link's own
  /// memory, left in place (empty if none are here, or the link keeps none); valid until
  /// the next call on this direction, and read(nullptr, k) then lets go of the first k. A
  /// consumer that reduces what arrives reads it there instead of copying it out first.
  virtual std::span<const uint8_t> peek(size_t /*n*/) { return {}; }
  /// True if inbound bytes are waiting (a message may be partly here).
  virtual bool readable() = 0;

  /// Wakes the peer's engine after this side wrote data or freed space.
  virtual void notifyPeer() = 0;
  /// True once the peer has left normally (destroyed its communicator) and everything it
  /// sent has been read; links whose peers leave through shared memory say so there.
  virtual bool peerLeft() const { return false; }
  /// The halves of peerLeft() for a link whose directions two threads drive (one writes,
  /// the other reads), each safe to ask on its own direction's thread: the peer has left
  /// and everything it sent has been read (inbound); the peer has left, so nothing more can
  /// be written to it (outbound).
  virtual bool inboundEnded() const { return peerLeft(); }
  virtual bool outboundEnded() const { return peerLeft(); }
  /// Whether the peer's inbound half exists yet (a network link's arrives when the peer first
  /// connects; a ring's always does). On the inbound direction's thread.
  virtual bool inboundMade() const { return true; }
  /// True if arrivals do not ring this rank's doorbell (the network delivers on its own), so
  /// an idle engine must look at this link now and then instead of sleeping until rung.
  virtual bool polled() const { return false; }
  /// True once everything written has left this process. A ring holds what it took; a
  /// network link may still queue frames, which move only while it is driven.
  virtual bool drained() { return true; }
};

}  // namespace loom
