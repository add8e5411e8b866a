// The network exchange of collectives across hosts.

#include "algorithms/network_context.h"

#include <sched.h>

#include <chrono>
#include <optional>
#include <thread>
#include <vector>

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;

// The transfers of one exchange with one peer, each direction in order.
struct PeerWork {
  int peer = 0;
  MessageLink* link = nullptr;
  std::vector<const NetTransfer*> sends, receives;
  size_t nextSend = 0;
  uint64_t sent = 0;  // of the send being handed over
  bool drained = false;
  size_t nextReceive = 0;
  bool receiving = false;  // the next receive's envelope has been read
  size_t received = 0;     // of that receive
  bool done() const { return drained && nextReceive == receives.size(); }
};

PeerWork& workFor(std::vector<PeerWork>& work, int peer) {
  for (PeerWork& w : work) {
    if (w.peer == peer) return w;
  }
  work.push_back({});
  work.back().peer = peer;
  return work.back();
}

}  // namespace

void NetworkContext::failWith(ErrorCode code, int q, const std::string& message) {
  failures_.fail(code, q, message);
  throw failures_.failureError(wait_.op);
}

void NetworkContext::exchange(std::span<const NetTransfer> sends,
                              std::span<const NetTransfer> receives) {
  std::vector<PeerWork> work;
  for (const NetTransfer& t : sends) workFor(work, t.peer).sends.push_back(&t);
  for (const NetTransfer& t : receives) workFor(work, t.peer).receives.push_back(&t);
  const std::string op(wait_.op);
  size_t left = work.size();
  size_t idleTurns = 0;
  int current = -1;  // the peer being driven, for failure messages
  try {
    for (PeerWork& w : work) {
      current = w.peer;
      w.link = &linkTo_(w.peer);
    }
    while (left > 0) {
      if (failures_.failed()) throw failures_.failureError(op);
      bool progressed = false;
      for (PeerWork& w : work) {
        if (w.done()) continue;
        current = w.peer;
        MessageLink& link = *w.link;
        // Sends: each handed over in turn; the peer's part is done once the link has
        // drained. A network link moves queued frames only while driven, and the peer may be
        // waiting for them before it sends what this rank waits for (a ring of three or
        // more hosts), so a send counts only once it has left.
        while (w.nextSend < w.sends.size()) {
          const NetTransfer& t = *w.sends[w.nextSend];
          const uint64_t before = w.sent;
          const bool handedOver =
              link.write({t.tag, t.bytes}, static_cast<const uint8_t*>(t.data), w.sent);
          progressed |= w.sent != before || handedOver;
          if (!handedOver) break;
          ++w.nextSend;
          w.sent = 0;
        }
        if (w.nextSend == w.sends.size() && !w.drained && link.drained()) {
          w.drained = true;
          progressed = true;
        }
        // Receives, in order.
        while (w.nextReceive < w.receives.size() && link.readable()) {
          const NetTransfer& t = *w.receives[w.nextReceive];
          if (!w.receiving) {
            const std::optional<Envelope> envelope = link.nextEnvelope();
            if (!envelope) break;
            if (envelope->tag != t.tag || envelope->bytes != t.bytes) {
              failWith(ErrorCode::kMismatch, t.peer,
                       op + " #" + std::to_string(wait_.seq) + ": " + describe_(t.peer) + " sent " +
                           std::to_string(envelope->bytes) + " bytes for step " +
                           std::to_string(envelope->tag) + " where this rank expected " +
                           std::to_string(t.bytes) + " for step " + std::to_string(t.tag) +
                           ": the ranks issued different collectives, counts or types");
            }
            w.receiving = true;
            progressed = true;
          }
          const size_t n =
              link.read(static_cast<uint8_t*>(t.data) + w.received, t.bytes - w.received);
          w.received += n;
          progressed |= n > 0;
          if (w.received < t.bytes) break;
          ++w.nextReceive;
          w.receiving = false;
          w.received = 0;
        }
        if (w.done()) {
          --left;
        } else if (link.peerLeft() && !link.readable()) {
          // It destroyed its communicator: what this rank still expects will never come.
          failures_.peerGone(w.peer, RankState::kDeparted, wait_);
        }
      }
      if (progressed) {
        idleTurns = 0;
        continue;
      }
      // Idle: a short spin, then yield, then sleep a little (the network rings no bell).
      if (Clock::now() >= wait_.deadline) {
        failWith(ErrorCode::kTimeout, current,
                 op + " #" + std::to_string(wait_.seq) + " hit its timeout of " +
                     std::to_string(wait_.timeout.count()) + " ms waiting for " +
                     describe_(current) + " over the network");
      }
      ++idleTurns;
      if (idleTurns < 64) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kPeerFailure && !failures_.failed() && current >= 0) {
      failures_.peerLost(current, e.detail());  // a link broke: name its peer
      throw failures_.failureError(op);
    }
    throw;
  }
}

}  // namespace loom
