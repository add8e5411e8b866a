// Lazy connections and named errors for links to other hosts.

#include "transport/net/net_link.h"

#include "loom/error.h"

namespace loom::net {

void NetLink::rethrow(const Error& e) const {
  if (peer_.empty()) throw e;
  // A peer failure is the link's or the peer's; anything else (a process out of
  // descriptors) happened on this side.
  const char* what = e.code() == ErrorCode::kPeerFailure ? " broke: " : " failed on this side: ";
  throw Error(e.code(), e.op(), e.rank(), "the link with " + peer_ + what + e.detail());
}

SendChannel* NetLink::outbound() {
  if (!out_ && connect_ && std::chrono::steady_clock::now() >= reconnectAt_) out_ = connect_();
  return out_.get();
}

void NetLink::turnedAway() {
  // Nothing went out on it: a channel takes no frame before the peer has answered.
  out_.reset();
  reconnectAt_ = std::chrono::steady_clock::now() + kReconnectAfter;
}

ReceiveChannel* NetLink::inbound() {
  if (!in_ && claim_) in_ = claim_();
  return in_.get();
}

bool NetLink::write(const Envelope& envelope, const uint8_t* payload, uint64_t& done) {
  return writeAs(envelope, payload, done, Payload::kCopied);
}

bool NetLink::writeBorrowed(const Envelope& envelope, const uint8_t* payload, uint64_t& done) {
  return writeAs(envelope, payload, done, Payload::kBorrowed);
}

bool NetLink::writeBorrowedPrefix(const Envelope& envelope, const uint8_t* payload, uint64_t& done,
                                  uint64_t ready) {
  return writeAs(envelope, payload, done, Payload::kBorrowed, ready);
}

bool NetLink::writeAs(const Envelope& envelope, const uint8_t* payload, uint64_t& done,
                      Payload mode, uint64_t produced) {
  try {
    SendChannel* out = outbound();
    return out && out->write(envelope, payload, done, mode, produced);
  } catch (const TurnedAway&) {
    turnedAway();
    return false;
  } catch (const Error& e) {
    rethrow(e);
  }
}

std::optional<Envelope> NetLink::nextEnvelope() {
  try {
    ReceiveChannel* in = inbound();
    return in ? in->nextEnvelope() : std::nullopt;
  } catch (const Error& e) {
    rethrow(e);
  }
}

size_t NetLink::read(void* dst, size_t n) {
  try {
    ReceiveChannel* in = inbound();
    return in ? in->read(dst, n) : 0;
  } catch (const Error& e) {
    rethrow(e);
  }
}

std::span<const uint8_t> NetLink::peek(size_t n) {
  try {
    ReceiveChannel* in = inbound();
    return in ? in->peek(n) : std::span<const uint8_t>{};
  } catch (const Error& e) {
    rethrow(e);
  }
}

bool NetLink::drained() {
  try {
    if (!out_) return true;
    out_->progress();
    return out_->flushed();
  } catch (const TurnedAway&) {
    turnedAway();
    return true;  // it had sent nothing
  } catch (const Error& e) {
    rethrow(e);
  }
}

bool NetLink::readable() {
  try {
    // The engine asks every link this on every turn: the turn to move our sends along too
    // (unless another thread drives them).
    if (out_ && drivers_ == Drivers::kOne) out_->progress();
    ReceiveChannel* in = inbound();
    return in && in->readable();
  } catch (const TurnedAway&) {
    turnedAway();
    return false;
  } catch (const Error& e) {
    rethrow(e);
  }
}

}  // namespace loom::net
