#pragma once

// The communicator's failure domain as transports and algorithms see it. One failure
// anywhere (a dead rank, a timeout, a mismatch, an abort) is recorded once and fails every
// rank of the communicator; waits that cannot go on report here, so what a failure says
// (who, where, what to do) is decided in one place: core/failure_domain, which implements
// this for ranks on this host through the shared segment and, beside it, for ranks on other
// hosts by messages.

#include <chrono>
#include <cstdint>
#include <span>
#include <string_view>
#include <thread>

#include "loom/error.h"

namespace loom {

/// Liveness of a rank.
enum class RankState : uint32_t {
  kAlive = 0,
  kDeparted = 1,  ///< destroyed its communicator normally
  kDead = 2,      ///< its process exited without doing so (set by whoever noticed)
};

/// How long a wait past its deadline listens for a reason found elsewhere before it reports
/// its own timeout, where what it waits for is itself waiting (a peer over the network, or
/// a rank of this host inside the same call): the rank behind them is named by its own
/// host's ranks, whose deadlines differ from this one's by the skew of the call's start,
/// and a reason from another host takes a control-plane turn to arrive.
inline constexpr std::chrono::milliseconds kTimeoutReasonGrace{2000};

/// What a wait needs to fail well: which operation, and until when.
struct WaitSpec {
  std::string_view op;
  uint64_t seq = 0;
  std::chrono::steady_clock::time_point deadline;
  std::chrono::milliseconds timeout{0};
};

class Failures {
 public:
  /// Records a failure for every rank (the first report wins) and wakes every waiter.
  virtual void fail(ErrorCode code, int culprit, std::string_view message) = 0;
  /// True once any rank has recorded a failure.
  virtual bool failed() const = 0;
  /// The recorded failure as an Error for operation `op` on this rank.
  virtual Error failureError(std::string_view op) const = 0;
  /// The rank the recorded failure names as its cause (dead, aborted, timed out), or -1.
  virtual int culprit() const = 0;
  /// Rank q's liveness.
  virtual RankState stateOf(int q) const = 0;
  /// Whether `ranks` can still make a communicator of their own: none of them has died, left
  /// or been lost, nor caused the recorded failure (if any) by dying, leaving, being lost or
  /// aborting. A timeout or a mismatch spares them: they all live.
  virtual bool spares(std::span<const int> ranks) const = 0;
  /// Why `ranks` cannot (spares is false), for operation `op`: a member gone after the
  /// recorded failure, by name, where that failure names another cause; else that failure.
  virtual Error sparingError(std::span<const int> ranks, std::string_view op) const = 0;
  /// A wait found rank q gone (`state`) before it posted what the wait needs: records why
  /// and throws the communicator's failure.
  [[noreturn]] virtual void peerGone(int q, RankState state, const WaitSpec& spec) = 0;
  /// The link to rank q broke (its process or host is gone, or the network between): marks
  /// q dead and fails the communicator with `why`.
  virtual void peerLost(int q, std::string_view why) = 0;
  /// Rank q (on another host) said it left normally: waits on it end as for a departed rank.
  virtual void peerLeft(int q) = 0;
  /// Rank q (on another host) said goodbye on its control link after it met this rank: it
  /// shut its communicator down. stateOf(q) stays as it was: a message q sent before it
  /// went may still be on its way over a link it made.
  virtual void noteGoodbye(int q) = 0;
  /// Whether rank q said goodbye (noteGoodbye): a wait on a link q never made ends on it.
  virtual bool saidGoodbye(int q) const = 0;
  /// A wait reached its deadline with some ranks short of `phase`: records who they are
  /// and where each one is, and throws.
  [[noreturn]] virtual void timedOut(uint64_t phase, const WaitSpec& spec) = 0;

 protected:
  ~Failures() = default;
};

/// Waits up to `grace` for a failure recorded (or forwarded) by another rank: true if there
/// is one, whose reason is then the one to report. Polls every millisecond.
inline bool failureWithin(const Failures& failures, std::chrono::milliseconds grace) {
  const auto until = std::chrono::steady_clock::now() + grace;
  while (!failures.failed() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return failures.failed();
}

}  // namespace loom
