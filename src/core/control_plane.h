#pragma once

// What keeps the hosts of a communicator agreed about failures. Each rank of local index
// below R (a rail rank, see algorithms/hierarchical.h) keeps a control link (channel 2) to
// its rail peer on every other host, and a thread that
//   - sends a heartbeat every tenth of `silence`;
//   - forwards the first failure recorded on this host (a dead rank, a timeout, a mismatch,
//     an abort) to those peers, which record it on theirs: every rank on every host then
//     fails with the same reason, whichever host it began on;
//   - fails the communicator when a peer that has spoken stays silent past `silence` (a dead
//     host or a cut link sends no closing) or its connection breaks without a goodbye;
//   - tells those peers which ranks of this host have left (destroyed their communicator),
//     and notes what they tell of theirs (Failures::noteGoodbye, in each host's segment): a
//     send or receive on any host with a rank that left before it ever connected there ends
//     at once, whether or not that rank held a control link itself.
// Creation waits until a word has come from every peer and this rank's first word is in each
// link (awaitPeers), so the hosts have met before the communicator is used, each peer's
// silence is timed from its first word, and a rank that leaves at once has spoken first: its
// peers tell its goodbye from a creation that failed there.

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "transport/failures.h"
#include "transport/message_link.h"

namespace loom::detail {

class ControlPlane {
 public:
  using MakeLink = std::function<std::unique_ptr<MessageLink>(int q)>;
  using Describe = std::function<std::string(int q)>;
  /// The ranks of this host that have left, in increasing order.
  using DepartedHere = std::function<std::vector<int>()>;
  /// Whether ranks a and b share a host.
  using SameHost = std::function<bool(int a, int b)>;

  /// Starts the thread for rank `rank` of a communicator of `size`, whose rail peers on
  /// other hosts are `peers`.
  ControlPlane(int rank, int size, const std::vector<int>& peers, const MakeLink& makeLink,
               Describe describe, DepartedHere departedHere, SameHost sameHost, Failures& failures,
               std::chrono::milliseconds silence);
  /// Stops the thread; the links say goodbye.
  ~ControlPlane();
  /// Waits until a word has come from every peer (so each peer's control plane runs: it has
  /// made the communicator and proved the secret) and this rank's first word to each is
  /// written. Throws Error(kTimeout) naming the peers not heard from by `deadline`, or the
  /// communicator's failure.
  void awaitPeers(std::chrono::steady_clock::time_point deadline);
  ControlPlane(const ControlPlane&) = delete;
  ControlPlane& operator=(const ControlPlane&) = delete;

 private:
  using Clock = std::chrono::steady_clock;
  struct Peer {
    int rank = 0;
    std::unique_ptr<MessageLink> link;
    std::optional<Clock::time_point> heard;  ///< the last word from it, once it has met us
    Clock::time_point nextBeat;
    bool done = false;    ///< left, broke or failed: nothing more to do with it
    bool toldUs = false;  ///< it sent the failure: no need to send it back
    bool forwarded = false;
    bool spoke = false;          ///< this rank's first word to it is written
    std::vector<int> announced;  ///< this host's departed ranks, as last told to it
    // the message going out
    bool sending = false;
    int outTag = 0;
    std::string out;
    uint64_t written = 0;
    // the message coming in
    std::optional<Envelope> in;
    std::string text;
    size_t got = 0;
  };

  void run();
  void serve(Peer& peer, Clock::time_point now, bool failedHere, const std::vector<int>& departed);
  void receive(Peer& peer, Clock::time_point now);
  /// Records the failure a peer forwarded (kFailure), under the culprit it names (checked:
  /// a rank of this communicator).
  void noteFailure(Peer& peer);
  /// Notes the ranks a peer's departure message names (checked: ranks of the peer's host,
  /// the only ones it speaks for).
  void noteDeparted(const Peer& peer);

  const int rank_;
  const int size_;
  Describe describe_;
  DepartedHere departedHere_;
  SameHost sameHost_;
  Failures& failures_;
  const std::chrono::milliseconds silence_;
  /// `lead` and the peers whose flag in `flags` is not set ("; not from <peer>, <peer>"), or
  /// nothing where every one is.
  std::string missingPeers(const std::unique_ptr<std::atomic<bool>[]>& flags,
                           std::string_view lead) const;

  std::vector<Peer> peers_;                         // the thread's only, but for the ranks it holds
  std::unique_ptr<std::atomic<bool>[]> heardFrom_;  // per peer, for missingPeers
  std::unique_ptr<std::atomic<bool>[]> spokeTo_;    // per peer: Peer::spoke, for other threads
  std::atomic<int> met_{0};                         // peers heard from
  std::atomic<int> spokenTo_{0};                    // peers this rank's first word is written to
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace loom::detail
