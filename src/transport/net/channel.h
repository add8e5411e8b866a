#pragma once

// One direction of message traffic between two ranks over one network connection.
//
// The initiator (SendChannel) connects and sends; the acceptor (ReceiveChannel) receives.
// Neither accepts a data byte before both have proved the job secret (wire.h, auth.h).
// Then the acceptor posts its window of `frames` receive buffers and grants it as credits;
// messages travel as frames of at most `frameBytes`, one per credit, and the acceptor
// returns credits as its reader drains frames, so no frame ever arrives without a buffer,
// whatever the provider. Sends go from the channel's own buffers, so a message's memory is
// free again once it is written, unless the writer lends it (Payload::kBorrowed): then the
// frames point into the writer's memory, which must stay untouched until flushed() or
// abandon(). Each channel is driven by one thread at a time; nothing here blocks.

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "loom/error.h"
#include "transport/message_link.h"
#include "transport/net/fabric.h"
#include "transport/net/wire.h"
#include "util/comm_id.h"

namespace loom::net {

/// Buffer sizes of a channel; both ends must agree (the bootstrap gives them the same).
struct ChannelShape {
  size_t frameBytes = size_t{128} << 10;  ///< one frame, header included
  int frames = 8;                         ///< receive buffers, and so frames in flight
};

/// How a write hands its payload over: copied into the channel's frame buffers, or
/// borrowed, sent straight from the caller's memory (saving a copy per byte).
enum class Payload { kCopied, kBorrowed };

/// SendChannel::write's `produced` for a payload that is all there.
inline constexpr uint64_t kWholePayload = ~uint64_t{0};

/// Thrown by SendChannel when the peer's process closed the connection without answering
/// its Hello: it held the connection for a communicator it has not made yet, as long as it
/// holds any (NetService::Limits::unexpectedHold), and let it go. Nothing was sent; the
/// initiator may connect again.
class TurnedAway : public Error {
 public:
  using Error::Error;
};

/// The initiator's end: connects, proves, sends.
class SendChannel {
 public:
  /// Starts connecting to `address` for the traffic `hello` names (its role and nonce are
  /// filled in here).
  SendChannel(Fabric& fabric, const std::string& address, Hello hello, const JobSecret& secret,
              ChannelShape shape);
  /// Says goodbye (if the connection is up and the peer is still there), then closes.
  ~SendChannel();
  SendChannel(const SendChannel&) = delete;
  SendChannel& operator=(const SendChannel&) = delete;
  /// Advances the connection and handshake; true once the peer has proved the secret.
  /// Throws Error(kPeerFailure) if the peer cannot be reached, refuses, or fails its proof,
  /// and TurnedAway if it closed the connection before answering.
  bool ready();
  /// MessageLink::write for this direction (false while not ready(), and for good once the
  /// peer has left). A borrowed payload must stay untouched until flushed() or abandon().
  /// Only the payload's first `produced` bytes exist yet: a frame goes once all of its bytes
  /// do, so frames stay full. Throws Error(kPeerFailure) once abandon() has discarded frames.
  bool write(const Envelope& envelope, const uint8_t* payload, uint64_t& done,
             Payload mode = Payload::kCopied, uint64_t produced = kWholePayload);
  /// True once the peer said goodbye: it destroyed its communicator normally.
  bool peerLeft() const { return peerLeft_; }
  /// True once every frame handed over has been sent, or will never be (the peer has left,
  /// or abandon() discarded them).
  bool flushed() const {
    return peerLeft_ || discarded_ || freeSlots_.size() == static_cast<size_t>(shape_.frames);
  }
  /// Moves frames already handed over along: providers may progress a send only while its
  /// completion queue is polled, so whoever drives the channel calls this between writes.
  void progress();
  /// For a writer that gives up its messages (its collective failed) and takes back the
  /// memory it lent: if frames from borrowed payloads are still queued, closes the
  /// connection, which discards them, so they are never read; the peer sees it close.
  void abandon() noexcept;
  /// For a writer that gives up what it queued (its communicator failed): sends nothing more
  /// of it, says goodbye if that goes out within 250 ms, and closes the connection, where the
  /// destructor would wait up to 10 s to deliver the frames and 2 s for the goodbye.
  void closeWithoutFlush() noexcept;
  /// Frames sent from borrowed payloads so far (tests check with it that the path was taken).
  uint64_t borrowedFrames() const { return borrowedFrames_; }
  /// Who this channel connects to, for messages.
  const std::string& peer() const { return peer_; }

 private:
  void pump();
  /// The endpoint's completions; a connection that ends before the peer's answer throws
  /// TurnedAway.
  size_t poll(std::span<Completion> done);
  void onReceive(uint8_t* buffer, size_t length);
  bool postFrame(const FrameHeader& header, const uint8_t* payload, bool borrow);
  /// Closes the connection if frames from borrowed payloads are queued (see abandon()).
  void discardBorrowed() noexcept;

  enum class Step { kConnecting, kSendHello, kAwaitReply, kSendProof, kReady };
  const ChannelShape shape_;
  const JobSecret secret_;
  std::unique_ptr<Endpoint> endpoint_;
  Step step_ = Step::kConnecting;
  Hello mine_;
  Hello theirs_;
  std::string peer_;
  std::vector<uint8_t> slots_;  // `frames` send buffers
  std::vector<int> freeSlots_;
  std::vector<uint8_t> lent_;  // per slot: its frame's payload is borrowed, not in the slot
  int lentInFlight_ = 0;       // slots whose frame points into a writer's memory
  uint64_t borrowedFrames_ = 0;
  bool discarded_ = false;       // abandon() or closeWithoutFlush() closed it
  std::vector<uint8_t> smalls_;  // receive buffers for the reply and credit frames
  int credits_ = 0;
  bool inMessage_ = false;  // the current message's first frame is out
  bool peerLeft_ = false;   // goodbye received: no more polling (the closing follows)
};

/// What the acceptor needs to take the traffic a Hello announces.
struct Expectation {
  JobSecret secret{};
  ChannelShape shape;
};
/// The acceptor's knowledge of the communicators it serves: the Expectation for the traffic
/// a Hello announces, or nullopt if it expects none (yet: the caller decides how long a
/// connection may wait for its communicator).
using SecretLookup = std::function<std::optional<Expectation>(const Hello&)>;

/// The acceptor's end: checks the proof, receives.
class ReceiveChannel {
 public:
  /// Takes an accepted endpoint that has not started yet. Until the initiator's proof
  /// checks out, the connection holds two 128-byte buffers and nothing more.
  ReceiveChannel(std::unique_ptr<Endpoint> endpoint, SecretLookup lookup);
  /// Says goodbye (if proven and the peer is still there), then closes.
  ~ReceiveChannel();
  ReceiveChannel(const ReceiveChannel&) = delete;
  ReceiveChannel& operator=(const ReceiveChannel&) = delete;
  /// Advances the handshake; true once the initiator has proved the secret and been granted
  /// the window. Throws Error(kPeerFailure) if it sends anything but the handshake or fails
  /// its proof.
  bool ready();
  /// True while the Hello has arrived but `lookup` does not know its traffic yet.
  bool awaitingLookup() const { return step_ == Step::kAwaitLookup; }
  /// Whether the initiator has said nothing yet (no Hello): nothing of a handshake is lost if
  /// it is closed now.
  bool saidNothing() const { return step_ == Step::kConnecting || step_ == Step::kAwaitHello; }
  /// The traffic this channel carries (meaningful once the Hello has arrived).
  const Hello& announced() const { return theirs_; }

  /// MessageLink's inbound half for this direction (see message_link.h). The stream's
  /// violations throw Error(kPeerFailure).
  std::optional<Envelope> nextEnvelope();
  size_t read(void* dst, size_t n);
  std::span<const uint8_t> peek(size_t n);
  bool readable();
  /// True once the initiator's goodbye has been read: everything it sent has been.
  bool peerLeft() const { return peerLeft_; }
  /// Who this channel accepted, for messages.
  const std::string& peer() const { return endpoint_->peer(); }

 private:
  struct Frame {
    int slot = -1;
    size_t length = 0;  // header included
  };
  void pump();
  std::optional<std::span<const uint8_t>> nextHandshakeMessage();
  uint8_t* slot(int i) {
    return buffers_.data() + static_cast<size_t>(i) * expected_.shape.frameBytes;
  }
  void recycle(int slot);
  void returnCredits();
  FrameHeader openFrame(const Frame& frame);
  /// Makes the current message's next arrived frame the current one, if there is none
  /// (polling the network if nothing has arrived); false if none is there to read from.
  bool continueMessage();
  [[noreturn]] void violation(const std::string& what);

  enum class Step {
    kConnecting,
    kAwaitHello,
    kAwaitLookup,
    kSendReply,
    kAwaitProof,
    kGrant,
    kReady
  };
  SecretLookup lookup_;
  std::unique_ptr<Endpoint> endpoint_;
  Step step_ = Step::kConnecting;
  Expectation expected_;
  Hello theirs_;
  Hello mine_;
  std::vector<uint8_t> handshake_;      // two buffers for the Hello and the Proof
  std::deque<Frame> handshakeArrived_;  // slot = context index
  std::vector<uint8_t> buffers_;        // the window: `frames` receive buffers, once proven
  std::deque<Frame> arrived_;           // in arrival order
  Frame current_;                       // the frame being read
  size_t currentOffset_ = 0;            // bytes of it read, header included
  MessageStream stream_;
  uint32_t owed_ = 0;           // credits not yet returned
  bool goodbyeQueued_ = false;  // a goodbye is among the arrivals: stop polling
  bool peerLeft_ = false;       // ... and has been read
};

}  // namespace loom::net
