// Heartbeats and failure forwarding between the hosts of a communicator.

#include "core/control_plane.h"

#include <cstring>
#include <optional>

#include "loom/error.h"
#include "util/bytes.h"
#include "util/posix.h"

namespace loom::detail {

namespace {

std::span<const uint8_t> bytesOf(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

constexpr int kHeartbeat = 1;
constexpr int kFailure = 2;   // the failure's code (one byte), its culprit (int32), its text
constexpr int kDeparted = 3;  // the sender's host's ranks that left so far, int32 each
constexpr size_t kMaxText = 4096;
constexpr size_t kFailureHeader = 1 + sizeof(int32_t);
constexpr auto kTurn = std::chrono::milliseconds(5);

}  // namespace

ControlPlane::ControlPlane(int rank, int size, const std::vector<int>& peers,
                           const MakeLink& makeLink, Describe describe, DepartedHere departedHere,
                           SameHost sameHost, Failures& failures, std::chrono::milliseconds silence)
    : rank_(rank),
      size_(size),
      describe_(std::move(describe)),
      departedHere_(std::move(departedHere)),
      sameHost_(std::move(sameHost)),
      failures_(failures),
      silence_(silence) {
  for (int q : peers) {
    Peer peer;
    peer.rank = q;
    peer.link = makeLink(q);
    peers_.push_back(std::move(peer));
  }
  heardFrom_ = std::make_unique<std::atomic<bool>[]>(peers_.size());
  spokeTo_ = std::make_unique<std::atomic<bool>[]>(peers_.size());
  thread_ = std::thread([this] {
    posix::nameThisThread("loom-control");
    run();
  });
}

ControlPlane::~ControlPlane() {
  stopping_.store(true, std::memory_order_release);
  thread_.join();
  // A failure recorded here may not have gone out yet (ranks that fail at once destroy
  // their communicator at once): deliver it before the links close, boundedly.
  if (!failures_.failed()) return;
  const auto deadline = Clock::now() + std::chrono::seconds(2);
  for (;;) {
    bool pending = false;
    const auto now = Clock::now();
    for (Peer& peer : peers_) {
      if (peer.done || peer.toldUs) continue;  // toldUs: it knows already
      try {
        // Asking the link whether it drained drives it, and a broken link throws.
        if (peer.forwarded && !peer.sending && peer.link->drained()) continue;  // delivered
        pending = true;
        serve(peer, now, true, peer.announced);
      } catch (const Error&) {
        peer.done = true;  // gone already: nobody to tell
      }
    }
    if (!pending || now >= deadline) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void ControlPlane::awaitPeers(Clock::time_point deadline) {
  bool failureSeen = false;
  std::optional<Clock::time_point> giveUpAt;
  const int n = static_cast<int>(peers_.size());
  while (met_.load(std::memory_order_acquire) < n ||
         spokenTo_.load(std::memory_order_acquire) < n) {
    // A failure recorded on this host while the last peers are met (ranks that finished
    // creating first may already have used the communicator and failed) leaves this thread a
    // few turns to hear them: then creation ends and the failure shows at the first call, as
    // it does on the ranks that were quicker. A peer not heard by then is not coming.
    // Another rank's creation timing out (recorded below) is that rank's view: this one goes
    // on waiting until its own deadline, to report what it saw itself.
    if (!failureSeen && failures_.failed()) {
      failureSeen = true;
      if (failures_.failureError("create").code() != ErrorCode::kTimeout) {
        giveUpAt = Clock::now() + 20 * kTurn;
      }
    }
    if (giveUpAt && Clock::now() > *giveUpAt) throw failures_.failureError("create");
    if (Clock::now() >= deadline) {
      // Recorded as the communicator's failure too (unless one is already): ranks that
      // finished creating (this host's through the segment, the peers heard from through
      // the links, before they close) must learn this reason, not that this rank left. This
      // rank reports what it saw itself.
      // The peer blamed: one not heard from, or else one this rank's first word never
      // reached (heard, so it is there, but this rank's connection to it is not made: an
      // address of it this host cannot reach?).
      int culprit = rank_;
      for (const auto* flags : {&heardFrom_, &spokeTo_}) {
        for (size_t i = 0; i < peers_.size() && culprit == rank_; ++i) {
          if (!(*flags)[i].load()) culprit = peers_[i].rank;
        }
      }
      const std::string detail =
          "not every rank on the other hosts joined rank " + std::to_string(rank_) +
          " within the timeout (heard from " + std::to_string(met_.load()) + " of " +
          std::to_string(n) + " peers" + missingPeers(heardFrom_, "; not from ") +
          "; its first word written to " + std::to_string(spokenTo_.load()) +
          missingPeers(spokeTo_, ", not to ") +
          "): did every rank make this communicator, and can the hosts reach each other "
          "(LOOM_NET_IFNAME)?";
      failures_.fail(ErrorCode::kTimeout, culprit, detail);
      throw Error(ErrorCode::kTimeout, "create", rank_, detail);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::string ControlPlane::missingPeers(const std::unique_ptr<std::atomic<bool>[]>& flags,
                                       std::string_view lead) const {
  std::string missing;
  for (size_t i = 0; i < peers_.size(); ++i) {
    if (flags[i].load()) continue;
    missing += (missing.empty() ? std::string(lead) : ", ") + describe_(peers_[i].rank);
  }
  return missing;
}

void ControlPlane::run() {
  while (!stopping_.load(std::memory_order_acquire)) {
    const auto now = Clock::now();
    const bool failedHere = failures_.failed();
    const std::vector<int> departed = departedHere_();
    for (Peer& peer : peers_) {
      if (peer.done) continue;
      try {
        serve(peer, now, failedHere, departed);
      } catch (const Error& e) {
        peer.done = true;
        // A failure on this side (out of descriptors) is this rank's, not the peer's.
        if (!failures_.failed()) {
          if (e.code() == ErrorCode::kPeerFailure) {
            failures_.peerLost(peer.rank, e.detail());
          } else {
            failures_.fail(e.code(), rank_, e.detail());
          }
        }
      }
    }
    std::this_thread::sleep_for(kTurn);
  }
}

void ControlPlane::serve(Peer& peer, Clock::time_point now, bool failedHere,
                         const std::vector<int>& departed) {
  // Out: the failure once (unless it came from this peer), else this host's departures when
  // they grew, else a heartbeat when due.
  if (!peer.sending) {
    if (failedHere && !peer.forwarded && !peer.toldUs) {
      // The culprit goes along so that every host knows which rank caused the failure, not
      // only the one whose link saw it (Failures::spares lets the others make a group).
      const Error failure = failures_.failureError("network");
      ByteWriter w;
      w.integer(static_cast<uint8_t>(failure.code()));
      w.integer(static_cast<int32_t>(failures_.culprit()));
      const std::string text = failure.detail().substr(0, kMaxText - kFailureHeader);
      w.raw(text.data(), text.size());
      peer.out.assign(w.bytes().begin(), w.bytes().end());
      peer.outTag = kFailure;
      peer.forwarded = peer.sending = true;
    } else if (departed != peer.announced && departed.size() * sizeof(int32_t) <= kMaxText) {
      ByteWriter w;
      for (int q : departed) w.integer(static_cast<int32_t>(q));
      peer.out.assign(w.bytes().begin(), w.bytes().end());
      peer.outTag = kDeparted;
      peer.sending = true;
      peer.announced = departed;
    } else if (now >= peer.nextBeat) {
      peer.out.clear();
      peer.outTag = kHeartbeat;
      peer.sending = true;
      peer.nextBeat = now + silence_ / 10;
    }
  }
  if (peer.sending &&
      peer.link->write({peer.outTag, peer.out.size()},
                       reinterpret_cast<const uint8_t*>(peer.out.data()), peer.written)) {
    peer.sending = false;
    peer.written = 0;
    // In the link, so delivered before its goodbye: creation ends only once every peer will
    // hear this rank, which may leave right after.
    if (!peer.spoke) {
      peer.spoke = true;
      spokeTo_[static_cast<size_t>(&peer - peers_.data())].store(true);
      spokenTo_.fetch_add(1, std::memory_order_release);
    }
  }
  receive(peer, now);
  // Its goodbye on its own channel comes after every frame it sent here (a failure it
  // forwards, its host's departures). The goodbye on this rank's channel to it, which it says
  // first as it closes its links, may come while those are still on their way: it ends the
  // peer only where nothing was ever heard from it (its part was never made).
  if (peer.link->inboundEnded() || (!peer.heard && peer.link->outboundEnded())) {
    peer.done = true;  // it destroyed its communicator normally: silence is expected now
    // Said for the collectives here: one that still waits on it over a link it never made
    // (it left before any collective with this rank) learns of it only so (drive()).
    if (peer.heard) failures_.noteGoodbye(peer.rank);
    // Before its first word, though, it never finished making it: creation here must not
    // wait out its timeout for a peer that is not coming.
    if (!peer.heard && !failedHere) {
      failures_.fail(ErrorCode::kPeerFailure, peer.rank,
                     describe_(peer.rank) +
                         " closed its connection before its control plane spoke: making this "
                         "communicator failed there (see its log)");
    }
    return;
  }
  if (!failedHere && peer.heard && now - *peer.heard > silence_) {
    peer.done = true;
    failures_.fail(ErrorCode::kPeerFailure, peer.rank,
                   "nothing heard from " + describe_(peer.rank) + " for " +
                       std::to_string(silence_.count()) +
                       " ms: its process, its host or the network to it is gone "
                       "(LOOM_NET_SILENCE_MS sets how long to wait)");
  }
}

void ControlPlane::receive(Peer& peer, Clock::time_point now) {
  while (peer.link->readable()) {
    if (!peer.in) {
      peer.in = peer.link->nextEnvelope();
      if (!peer.in) return;
      const bool known = peer.in->tag == kHeartbeat ||
                         (peer.in->tag == kFailure && peer.in->bytes >= kFailureHeader) ||
                         (peer.in->tag == kDeparted && peer.in->bytes % sizeof(int32_t) == 0);
      if (!known || peer.in->bytes > kMaxText) {
        throw Error(ErrorCode::kPeerFailure, "network", rank_,
                    "a malformed control message (tag " + std::to_string(peer.in->tag) + ", " +
                        std::to_string(peer.in->bytes) + " bytes)");
      }
      peer.text.assign(peer.in->bytes, '\0');
      peer.got = 0;
      // Met: the peer's control plane runs (a word written to it proved only that its
      // process had registered the communicator, which it does long before, while its host's
      // ranks gather). Silence counts from here; until then creation's deadline waits.
      if (!peer.heard) {
        heardFrom_[static_cast<size_t>(&peer - peers_.data())].store(true);
        met_.fetch_add(1, std::memory_order_release);
      }
      peer.heard = now;
    }
    const size_t n = peer.link->read(peer.text.data() + peer.got, peer.text.size() - peer.got);
    peer.got += n;
    if (n > 0 && peer.heard) peer.heard = now;
    if (peer.got < peer.text.size()) return;
    if (peer.in->tag == kFailure) noteFailure(peer);
    if (peer.in->tag == kDeparted) noteDeparted(peer);
    peer.in.reset();
  }
}

void ControlPlane::noteFailure(Peer& peer) {
  peer.toldUs = true;
  ByteReader in(bytesOf(peer.text));
  uint8_t code = 0;
  int32_t culprit = 0;
  in.integer(&code);  // receive() let in no failure shorter than its header
  in.integer(&culprit);
  if (culprit < -1 || culprit >= size_) {
    throw Error(ErrorCode::kPeerFailure, "network", rank_,
                "a malformed control message: " + describe_(peer.rank) +
                    " reports a failure caused by rank " + std::to_string(culprit) +
                    ", which is not a rank of this communicator");
  }
  // The failure keeps its code and culprit, so every host answers alike which ranks it
  // spares (Failures::spares); a code this build does not know is a peer failure, and one
  // whose cause is unknown (-1) is blamed on the host that reported it.
  const bool known = code <= static_cast<uint8_t>(ErrorCode::kInternal);
  failures_.fail(known ? static_cast<ErrorCode>(code) : ErrorCode::kPeerFailure,
                 culprit < 0 || !known ? peer.rank : culprit,
                 describe_(peer.rank) + " reports: " + peer.text.substr(kFailureHeader));
}

void ControlPlane::noteDeparted(const Peer& peer) {
  ByteReader in(bytesOf(peer.text));
  for (int32_t q = 0; in.integer(&q);) {
    // A peer speaks for its own host's ranks only: a goodbye noted here is every local
    // rank's to act on, and is never taken back.
    if (q < 0 || q >= size_ || !sameHost_(q, peer.rank)) {
      throw Error(ErrorCode::kPeerFailure, "network", rank_,
                  "a malformed control message: " + describe_(peer.rank) + " says rank " +
                      std::to_string(q) + " left, which is not a rank of its host");
    }
    failures_.noteGoodbye(q);
  }
}

}  // namespace loom::detail
