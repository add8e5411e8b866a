// Handshakes, frames and credits of one network connection.

#include "transport/net/channel.h"

#include <algorithm>
#include <cstring>

#include "loom/error.h"
#include "transport/net/auth.h"

namespace loom::net {

namespace {

// Receive buffers of the initiator: the acceptor's reply, then credit frames. Each credit
// frame returns at least a quarter of the window, so at most four are ever waiting; eight
// is room.
constexpr int kSmallBuffers = 8;
constexpr size_t kSmallBytes = 128;
constexpr size_t kReplyBytes = kHelloBytes + kProofBytes;
static_assert(kReplyBytes <= kSmallBytes && kFrameHeaderBytes <= kSmallBytes);

// Tells the other end that this one leaves normally; best effort (it may be gone already).
// The goodbye is sent with a completion and awaited, because closing right behind a queued
// message may drop it; the wait is bounded, and a peer that is already gone ends it.
constexpr auto kGoodbyePatience = std::chrono::milliseconds(2000);
// A writer that gives up what it has queued waits less: over a cut link the goodbye never
// goes out, and each of the communicator's channels would wait in turn.
constexpr auto kGivingUpPatience = std::chrono::milliseconds(250);
void* const kGoodbyeContext = reinterpret_cast<void*>(~uintptr_t{0});
// How long an acceptor waits for its version note to go out before it closes the connection:
// short, as the acceptor's one thread serves every handshake meanwhile (anyone can send a
// Hello of another version); over tcp the note goes out at once.
constexpr auto kVersionNotePatience = std::chrono::milliseconds(20);

// Sends `bytes` with a completion and waits for it (closing right behind a queued message
// may drop it), at most `patience`; a peer already gone is nobody to tell.
void sendBeforeClosing(Endpoint& endpoint, std::span<const uint8_t> bytes,
                       std::chrono::milliseconds patience) {
  const iovec part{const_cast<uint8_t*>(bytes.data()), bytes.size()};
  const auto deadline = std::chrono::steady_clock::now() + patience;
  try {
    while (!endpoint.postSend({&part, 1}, kGoodbyeContext)) {
      if (std::chrono::steady_clock::now() > deadline) return;
      Completion ignored[16];
      endpoint.poll(ignored);
    }
    Completion done[16];
    while (std::chrono::steady_clock::now() < deadline) {
      const size_t n = endpoint.poll(done);
      for (size_t i = 0; i < n; ++i) {
        if (done[i].context == kGoodbyeContext) return;
      }
    }
  } catch (const Error&) {
    // The peer is gone already: nobody to tell.
  }
}

void sayGoodbye(Endpoint& endpoint,
                std::chrono::milliseconds patience = std::chrono::milliseconds(kGoodbyePatience)) {
  FrameHeader header;
  header.type = FrameType::kGoodbye;
  uint8_t bytes[kFrameHeaderBytes];
  encodeFrameHeader(header, bytes);
  sendBeforeClosing(endpoint, bytes, patience);
}

void* contextOf(int index) {
  return reinterpret_cast<void*>(static_cast<uintptr_t>(index) + 1);
}
int indexOf(void* context) {
  return static_cast<int>(reinterpret_cast<uintptr_t>(context) - 1);
}

std::string trafficOf(const Hello& h) {
  return "communicator " + toHex(h.comm, 4) + ", rank " + std::to_string(h.sender) + " -> rank " +
         std::to_string(h.receiver) + ", channel " + std::to_string(h.channel);
}

// Handshake contexts follow the frame buffers' (a window has far fewer frames).
constexpr int kHandshakeContext = 1 << 20;

void requireShape(const ChannelShape& shape) {
  if (shape.frames < 2 || shape.frames >= kHandshakeContext ||
      shape.frameBytes <= kFrameHeaderBytes || shape.frameBytes > (size_t{1} << 30)) {
    throw Error(ErrorCode::kInvalidArgument, "network", -1,
                "a channel needs 2 or more frames of more than " +
                    std::to_string(kFrameHeaderBytes) + " bytes (and at most 1 GiB)");
  }
}

void requireInline(const Endpoint& endpoint) {
  if (endpoint.injectLimit() < kReplyBytes) {
    throw Error(ErrorCode::kUnsupported, "network", -1,
                "this libfabric provider sends at most " + std::to_string(endpoint.injectLimit()) +
                    " bytes inline; loom's handshake needs " + std::to_string(kReplyBytes) +
                    "; choose another with LOOM_NET_PROVIDER");
  }
}

}  // namespace

// ---- SendChannel ----

SendChannel::SendChannel(Fabric& fabric, const std::string& address, Hello hello,
                         const JobSecret& secret, ChannelShape shape)
    : shape_(shape),
      secret_(secret),
      endpoint_(fabric.connect(address)),
      mine_(hello),
      peer_(endpoint_->peer()) {
  requireShape(shape_);
  requireInline(*endpoint_);
  mine_.role = Role::kInitiator;
  mine_.nonce = freshNonce();
  slots_.resize(static_cast<size_t>(shape_.frames) * shape_.frameBytes);
  lent_.assign(static_cast<size_t>(shape_.frames), 0);
  for (int i = shape_.frames - 1; i >= 0; --i) freeSlots_.push_back(i);
  smalls_.resize(kSmallBuffers * kSmallBytes);
  for (int i = 0; i < kSmallBuffers; ++i) {
    endpoint_->postReceive(smalls_.data() + i * kSmallBytes, kSmallBytes, contextOf(i));
  }
  // No credits until the acceptor, having checked the proof, grants its window.
  endpoint_->start();
}

SendChannel::~SendChannel() {
  if (step_ == Step::kReady && !peerLeft_ && !discarded_) {
    // A written message is the channel's to deliver: let the frames still queued go first
    // (bounded; a peer that leaves or fails ends it).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    try {
      while (!peerLeft_ && freeSlots_.size() < static_cast<size_t>(shape_.frames) &&
             std::chrono::steady_clock::now() < deadline) {
        pump();
      }
    } catch (const Error&) {
    }
    if (!peerLeft_) sayGoodbye(*endpoint_);
  }
  endpoint_.reset();  // closed while the buffers it may still point into are alive
}

bool SendChannel::ready() {
  switch (step_) {
    case Step::kConnecting:
      if (!endpoint_->connected()) return false;
      step_ = Step::kSendHello;
      [[fallthrough]];
    case Step::kSendHello: {
      const auto bytes = encodeHello(mine_);
      if (!endpoint_->inject(bytes.data(), bytes.size())) return false;
      step_ = Step::kAwaitReply;
      [[fallthrough]];
    }
    case Step::kAwaitReply:
      pump();
      if (step_ == Step::kAwaitReply) return false;
      [[fallthrough]];
    case Step::kSendProof: {
      const auto bytes = encodeProof(makeProof(secret_, Role::kInitiator, mine_, theirs_));
      if (!endpoint_->inject(bytes.data(), bytes.size())) return false;
      step_ = Step::kReady;
      [[fallthrough]];
    }
    case Step::kReady: return true;
  }
  return false;
}

void SendChannel::progress() {
  if (!discarded_ && ready()) pump();
}

void SendChannel::abandon() noexcept {
  discardBorrowed();
}

void SendChannel::closeWithoutFlush() noexcept {
  if (!endpoint_) return;
  // Behind what the provider already holds; a live peer reads it as a normal leave (a
  // connection closed without one reads as this rank lost, which would race the real
  // reason, forwarded by the control plane).
  if (step_ == Step::kReady && !peerLeft_ && !discarded_) sayGoodbye(*endpoint_, kGivingUpPatience);
  endpoint_.reset();  // discards every send still outstanding (see discardBorrowed)
  discarded_ = true;
  lentInFlight_ = 0;
}

void SendChannel::discardBorrowed() noexcept {
  if (lentInFlight_ == 0 || !endpoint_) return;
  // A posted send cannot be recalled, and the provider reads its memory until it completes;
  // closing the endpoint discards every operation still outstanding (fi_endpoint(3),
  // fi_close), so the lender may reuse or free its memory at once.
  endpoint_.reset();
  discarded_ = true;
  lentInFlight_ = 0;
}

size_t SendChannel::poll(std::span<Completion> done) {
  if (step_ != Step::kAwaitReply) return endpoint_->poll(done);
  try {
    return endpoint_->poll(done);
  } catch (const Error& e) {
    // Up, Hello sent, no answer, and now closed: the peer's process did not know this
    // communicator (yet) and stopped holding the connection. A process that is gone refuses
    // the next connection instead, which is not this.
    throw TurnedAway(ErrorCode::kPeerFailure, "connect", mine_.sender,
                     "the process at " + peer() + " closed the connection without answering (" +
                         trafficOf(mine_) + "; " + e.detail() + ")");
  }
}

void SendChannel::pump() {
  Completion done[16];
  while (!peerLeft_) {
    const size_t n = poll(done);
    for (size_t i = 0; i < n; ++i) {
      const int index = indexOf(done[i].context);
      if (!done[i].isReceive) {
        if (lent_[index] != 0) {
          lent_[index] = 0;
          --lentInFlight_;
        }
        freeSlots_.push_back(index);
        continue;
      }
      uint8_t* buffer = smalls_.data() + index * kSmallBytes;
      onReceive(buffer, done[i].length);
      if (peerLeft_) {
        // Nothing more will be taken, and flushed() now lets writers reuse what they lent.
        discardBorrowed();
        return;
      }
      endpoint_->postReceive(buffer, kSmallBytes, done[i].context);
    }
    if (n < std::size(done)) return;
  }
}

void SendChannel::onReceive(uint8_t* buffer, size_t length) {
  auto refuse = [this](const std::string& why) {
    throw Error(ErrorCode::kPeerFailure, "connect", mine_.sender,
                "the peer at " + peer() + " (" + trafficOf(mine_) + ") " + why);
  };
  if (step_ == Step::kAwaitReply) {
    const std::span<const uint8_t> bytes(buffer, length);
    const auto version = length == kVersionNoteBytes ? declaredVersion(bytes) : std::nullopt;
    if (version && *version != kWireVersion) {
      refuse("runs a loom build that speaks wire version " + std::to_string(*version) +
             ", where this one speaks " + std::to_string(kWireVersion) +
             ": install the same loom release on every host");
    }
    const auto hello = length == kReplyBytes ? parseHello(bytes.first(kHelloBytes)) : std::nullopt;
    const auto proof =
        length == kReplyBytes ? parseProof(bytes.subspan(kHelloBytes)) : std::nullopt;
    if (!hello || !proof) refuse("answered with something that is not a loom handshake");
    if (hello->role != Role::kAcceptor || hello->comm != mine_.comm ||
        hello->sender != mine_.sender || hello->receiver != mine_.receiver ||
        hello->channel != mine_.channel) {
      refuse("answered for other traffic (" + trafficOf(*hello) + ")");
    }
    theirs_ = *hello;
    if (!checkProof(secret_, Role::kAcceptor, mine_, theirs_, *proof)) {
      refuse("did not prove the job secret: is another job using this address?");
    }
    step_ = Step::kSendProof;
    return;
  }
  const auto header = step_ == Step::kReady && length == kFrameHeaderBytes
                          ? parseFrameHeader({buffer, length})
                          : std::nullopt;
  if (header && header->type == FrameType::kGoodbye) {
    peerLeft_ = true;
    return;
  }
  if (!header || header->type != FrameType::kCredit ||
      header->credits > static_cast<uint32_t>(shape_.frames - credits_)) {
    refuse("broke the protocol (an unexpected or malformed credit frame)");
  }
  credits_ += static_cast<int>(header->credits);
}

bool SendChannel::postFrame(const FrameHeader& header, const uint8_t* payload, bool borrow) {
  const int index = freeSlots_.back();
  uint8_t* slot = slots_.data() + static_cast<size_t>(index) * shape_.frameBytes;
  encodeFrameHeader(header, slot);
  iovec parts[2] = {{slot, kFrameHeaderBytes}, {const_cast<uint8_t*>(payload), header.length}};
  if (!borrow) {  // the payload follows the header in the slot
    if (header.length != 0) std::memcpy(slot + kFrameHeaderBytes, payload, header.length);
    parts[0].iov_len += header.length;
  }
  if (!endpoint_->postSend({parts, borrow ? size_t{2} : size_t{1}}, contextOf(index))) {
    return false;
  }
  freeSlots_.pop_back();
  --credits_;
  if (borrow) {
    lent_[index] = 1;
    ++lentInFlight_;
    ++borrowedFrames_;
  }
  return true;
}

bool SendChannel::write(const Envelope& envelope, const uint8_t* payload, uint64_t& done,
                        Payload mode, uint64_t produced) {
  if (peerLeft_) return false;
  if (discarded_) {
    throw Error(ErrorCode::kPeerFailure, "send", mine_.sender,
                "the connection to " + peer_ +
                    " was closed when a failed collective gave up the frames it had queued");
  }
  if (!ready()) return false;
  pump();
  if (peerLeft_) return false;
  // A provider that takes one part per send only gets copies.
  const bool borrow = mode == Payload::kBorrowed && endpoint_->iovLimit() >= 2;
  const uint64_t room = shape_.frameBytes - kFrameHeaderBytes;
  for (;;) {
    if (inMessage_ && done == envelope.bytes) {
      inMessage_ = false;
      return true;
    }
    if (credits_ == 0 || freeSlots_.empty()) return false;
    FrameHeader header;
    header.type = FrameType::kData;
    header.first = !inMessage_;
    header.envelope = envelope;
    header.length = static_cast<uint32_t>(std::min(room, envelope.bytes - done));
    if (done + header.length > std::min(produced, envelope.bytes)) return false;  // not yet
    if (!postFrame(header, payload + done, borrow && header.length != 0)) return false;
    inMessage_ = true;
    done += header.length;
  }
}

// ---- ReceiveChannel ----

ReceiveChannel::ReceiveChannel(std::unique_ptr<Endpoint> endpoint, SecretLookup lookup)
    : lookup_(std::move(lookup)), endpoint_(std::move(endpoint)) {
  requireInline(*endpoint_);
  // Until the initiator has proved the secret it may send two messages, each into one of
  // these; the window of frame buffers is posted only after the proof.
  handshake_.resize(2 * kSmallBytes);
  for (int i = 0; i < 2; ++i) {
    endpoint_->postReceive(handshake_.data() + i * kSmallBytes, kSmallBytes,
                           contextOf(kHandshakeContext + i));
  }
  endpoint_->start();
}

ReceiveChannel::~ReceiveChannel() {
  if (step_ == Step::kReady && !goodbyeQueued_) sayGoodbye(*endpoint_);
  endpoint_.reset();  // closed while the buffers it may still point into are alive
}

void ReceiveChannel::violation(const std::string& what) {
  const std::string who =
      step_ == Step::kReady ? "rank " + std::to_string(theirs_.sender) + " at " : "the process at ";
  throw Error(ErrorCode::kPeerFailure, "network", step_ == Step::kReady ? theirs_.receiver : -1,
              who + peer() + " " + what);
}

std::optional<std::span<const uint8_t>> ReceiveChannel::nextHandshakeMessage() {
  pump();
  if (handshakeArrived_.empty()) return std::nullopt;
  const Frame message = handshakeArrived_.front();
  handshakeArrived_.pop_front();
  return std::span<const uint8_t>(
      handshake_.data() + (message.slot - kHandshakeContext) * kSmallBytes, message.length);
}

bool ReceiveChannel::ready() {
  switch (step_) {
    case Step::kConnecting:
      if (!endpoint_->connected()) return false;
      step_ = Step::kAwaitHello;
      [[fallthrough]];
    case Step::kAwaitHello: {
      const auto message = nextHandshakeMessage();
      if (!message) return false;
      const auto hello = parseHello(*message);
      const auto version = declaredVersion(*message);
      if (!hello && version && *version != kWireVersion) {
        // Another loom build: tell its initiator which version speaks here, so that it
        // names both rather than connecting again until its timeout.
        sendBeforeClosing(*endpoint_, encodeVersionNote(), kVersionNotePatience);
        violation("speaks loom wire version " + std::to_string(*version) + " where this build " +
                  "speaks " + std::to_string(kWireVersion) + "; connection refused");
      }
      if (!hello || hello->role != Role::kInitiator) {
        violation("did not open with a loom handshake; connection refused");
      }
      theirs_ = *hello;
      step_ = Step::kAwaitLookup;
      [[fallthrough]];
    }
    case Step::kAwaitLookup: {
      const auto expected = lookup_(theirs_);
      if (!expected) return false;  // not (yet) expected here: the holder decides how long
      expected_ = *expected;
      requireShape(expected_.shape);
      mine_ = theirs_;
      mine_.role = Role::kAcceptor;
      mine_.nonce = freshNonce();
      step_ = Step::kSendReply;
      [[fallthrough]];
    }
    case Step::kSendReply: {
      uint8_t reply[kHelloBytes + kProofBytes];
      const auto hello = encodeHello(mine_);
      const auto proof = encodeProof(makeProof(expected_.secret, Role::kAcceptor, theirs_, mine_));
      std::memcpy(reply, hello.data(), hello.size());
      std::memcpy(reply + hello.size(), proof.data(), proof.size());
      if (!endpoint_->inject(reply, sizeof reply)) return false;
      step_ = Step::kAwaitProof;
      [[fallthrough]];
    }
    case Step::kAwaitProof: {
      const auto message = nextHandshakeMessage();
      if (!message) return false;
      const auto proof = parseProof(*message);
      if (!proof || !checkProof(expected_.secret, Role::kInitiator, theirs_, mine_, *proof)) {
        violation("did not prove the job secret (" + trafficOf(theirs_) +
                  "); connection refused before any data");
      }
      // Proven: post the window and grant it whole.
      const ChannelShape& shape = expected_.shape;
      buffers_.resize(static_cast<size_t>(shape.frames) * shape.frameBytes);
      for (int i = 0; i < shape.frames; ++i) recycle(i);
      step_ = Step::kGrant;
      [[fallthrough]];
    }
    case Step::kGrant:
      returnCredits();
      if (owed_ != 0) return false;
      step_ = Step::kReady;
      [[fallthrough]];
    case Step::kReady: return true;
  }
  return false;
}

void ReceiveChannel::pump() {
  Completion done[16];
  while (!goodbyeQueued_) {
    const size_t n = endpoint_->poll(done);
    for (size_t i = 0; i < n; ++i) {
      if (!done[i].isReceive) continue;
      const int index = indexOf(done[i].context);
      if (index >= kHandshakeContext) {
        handshakeArrived_.push_back({index, done[i].length});
        continue;
      }
      arrived_.push_back({index, done[i].length});
      // Past a goodbye only the connection's closing can come: stop looking at once (the
      // goodbye itself is read in its turn, after the frames before it).
      goodbyeQueued_ |= done[i].length == kFrameHeaderBytes &&
                        slot(index)[0] == static_cast<uint8_t>(FrameType::kGoodbye);
    }
    if (n < std::size(done)) break;
  }
  if (step_ == Step::kReady) returnCredits();
}

void ReceiveChannel::recycle(int index) {
  endpoint_->postReceive(slot(index), expected_.shape.frameBytes, contextOf(index));
  ++owed_;
}

void ReceiveChannel::returnCredits() {
  if (goodbyeQueued_) return;  // the sender has left: nobody to give them to
  // Returning a quarter of the window at a time keeps credit frames few while the sender
  // still has three quarters to go on with; it cannot be starved by this, since with no
  // credits left all `frames` buffers are ours to drain.
  if (owed_ < static_cast<uint32_t>(std::max(1, expected_.shape.frames / 4))) return;
  FrameHeader header;
  header.type = FrameType::kCredit;
  header.credits = owed_;
  uint8_t bytes[kFrameHeaderBytes];
  encodeFrameHeader(header, bytes);
  if (endpoint_->inject(bytes, sizeof bytes)) owed_ = 0;  // else: again on the next pump
}

FrameHeader ReceiveChannel::openFrame(const Frame& frame) {
  const auto header = parseFrameHeader({slot(frame.slot), frame.length});
  if (!header) violation("sent a malformed frame");
  if (header->type == FrameType::kGoodbye) {
    if (!stream_.idle()) violation("left in the middle of a message");
    return *header;
  }
  if (auto problem = stream_.accept(*header)) violation("broke the message stream: " + *problem);
  return *header;
}

std::optional<Envelope> ReceiveChannel::nextEnvelope() {
  if (!ready()) return std::nullopt;
  pump();
  if (current_.slot >= 0 || !stream_.idle()) {
    throw Error(ErrorCode::kInternal, "recv", theirs_.receiver,
                "asked for the next message before the last one was read");
  }
  if (arrived_.empty() || peerLeft_) return std::nullopt;
  current_ = arrived_.front();
  arrived_.pop_front();
  const FrameHeader header = openFrame(current_);
  if (header.type == FrameType::kGoodbye) {
    peerLeft_ = true;
    current_ = Frame{};
    return std::nullopt;
  }
  if (!header.first) violation("continued a message that never began");
  currentOffset_ = kFrameHeaderBytes;
  if (currentOffset_ == current_.length) {
    recycle(current_.slot);
    current_ = Frame{};
  }
  return header.envelope;
}

bool ReceiveChannel::continueMessage() {
  if (current_.slot >= 0) return true;
  // Look at the network only once what has arrived is read: a consumer taking a frame at a
  // time (peek, then read) polls once per frame, not once per call.
  if (arrived_.empty()) pump();
  if (arrived_.empty() || stream_.idle()) return false;  // the message's next frame is not here
  current_ = arrived_.front();
  arrived_.pop_front();
  currentOffset_ = kFrameHeaderBytes;
  const FrameHeader header = openFrame(current_);  // a goodbye here is a violation
  if (header.first) violation("began a message inside another");
  return true;
}

std::span<const uint8_t> ReceiveChannel::peek(size_t n) {
  if (!ready()) return {};
  if (!continueMessage()) return {};
  return {slot(current_.slot) + currentOffset_, std::min(n, current_.length - currentOffset_)};
}

size_t ReceiveChannel::read(void* dst, size_t n) {
  if (!ready()) return 0;
  auto* out = static_cast<uint8_t*>(dst);
  size_t total = 0;
  while (total < n) {
    if (!continueMessage()) break;
    const size_t m = std::min(n - total, current_.length - currentOffset_);
    if (out != nullptr) std::memcpy(out + total, slot(current_.slot) + currentOffset_, m);
    total += m;
    currentOffset_ += m;
    if (currentOffset_ == current_.length) {
      recycle(current_.slot);
      current_ = Frame{};
    }
  }
  returnCredits();
  return total;
}

bool ReceiveChannel::readable() {
  if (!ready()) return false;
  pump();
  return !peerLeft_ && (current_.slot >= 0 || !arrived_.empty());
}

}  // namespace loom::net
