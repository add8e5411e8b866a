#pragma once

// One per process: a Unix socket in the abstract namespace (no file to leak) where the
// leaders of this process's communicators receive their members, and a watcher that
// reports when a peer process exits. Both run on one background thread driven by poll().

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/handshake.h"
#include "util/comm_id.h"
#include "util/posix.h"

namespace loom {

/// Processes watched while a communicator is made: which of them has exited (pidfds, so an
/// exited process not yet reaped counts too).
class ExitWatch {
 public:
  /// Watches each (rank, pid); a pid that no longer exists counts as exited, one that cannot
  /// be watched otherwise is left out.
  explicit ExitWatch(const std::vector<std::pair<int, int>>& rankPids);
  ExitWatch(const ExitWatch&) = delete;
  ExitWatch& operator=(const ExitWatch&) = delete;
  /// The (rank, pid) of a watched process that has exited, if any.
  std::optional<std::pair<int, int>> exited() const;

 private:
  struct Watched {
    int rank;
    int pid;
    posix::Fd pidfd;
  };
  std::vector<Watched> watched_;
  std::optional<std::pair<int, int>> gone_;  // the first found gone already
};

/// A member that connected to a leader and passed the checks.
struct Arrival {
  handshake::Hello hello;
  posix::Fd socket;
  int peerPid = 0;  ///< from SO_PEERCRED, in this process's pid namespace
};

class ProcessService {
 public:
  using Clock = std::chrono::steady_clock;

  /// This process's service, started on first use (and again in a forked child).
  static ProcessService& instance();

  /// The abstract socket name members connect to (without the leading NUL byte).
  const std::string& address() const { return address_; }

  /// Called every few milliseconds while a leader or member waits: throws (an Error naming
  /// a member that died meanwhile) to end the wait at once instead of at its deadline.
  using StillAlive = std::function<void()>;

  /// Leader side: waits for `count` members of communicator `comm` presenting `secret`,
  /// each with a local index in [1, ranks.size()); `ranks` holds the communicator rank of
  /// each local index (the leader's first), for messages. Throws Error(kTimeout) at
  /// `deadline` naming the ranks that never came, or what `stillAlive` throws.
  /// `hint` ends the timeout's message: what the user should check. A leader that fails
  /// here has abandoned `comm` (below).
  std::vector<Arrival> acceptMembers(const CommId& comm, const handshake::Secret& secret, int count,
                                     std::span<const int> ranks, Clock::time_point deadline,
                                     const StillAlive& stillAlive = nullptr,
                                     std::string_view hint = kStoreHint);
  /// What acceptMembers' timeout suggests by default, for communicators made through a store.
  static constexpr std::string_view kStoreHint =
      "did they all call create with the same store, or did one fail earlier?";

  /// Tells a member that came why it is not taken: a Welcome of `status` (not 0) with
  /// `reason`, and no descriptor.
  static void refuse(const Arrival& member, int32_t status, const std::string& reason);
  /// What members hear when their leader, communicator rank `leader`, gives up making the
  /// communicator (a Welcome's reason, kept short), `why` being the leader's own error.
  static std::string leaderGaveUp(int leader, const std::string& why);

  /// Leader side: this process will not make `comm` (it failed, or gave up, for `reason`):
  /// members that come for it, or wait for it already, are refused at once with the reason
  /// instead of waiting out their own deadline.
  void abandon(const CommId& comm, const std::string& reason);

  /// What a member is handed: the segment, and its connection to the leader, on which it
  /// confirms (confirmJoined) once it has attached the segment.
  struct Welcomed {
    posix::Fd segment;
    posix::Fd leader;
  };
  /// Member side: connects to the leader at `address`, presents itself, and returns the
  /// segment fd it is given. Throws Error on refusal, timeout or a dead leader, or what
  /// `stillAlive` throws; errors name `rank`, this member's communicator rank (the Hello
  /// carries its local index).
  Welcomed joinLeader(const std::string& address, const handshake::Hello& hello, int rank,
                      Clock::time_point deadline, const StillAlive& stillAlive = nullptr);
  /// Member side: tells the leader this member holds the segment (the leader waits for
  /// every member's word before it uses the communicator; see CommState::joinSegment).
  static void confirmJoined(const Welcomed& welcomed);
  /// Member side, the first half of joinLeader: connects to the leader at `address` (a
  /// process of this uid only) and sends the Hello; returns the socket for what follows.
  posix::Fd introduce(const std::string& address, const handshake::Hello& hello, int rank,
                      Clock::time_point deadline, const StillAlive& stillAlive = nullptr);

  /// Calls `onExit(pid)` on the service thread when process `pid` exits. Returns an id for
  /// unwatch(). Returns 0 if the process cannot be watched: one that has exited already is
  /// reported at once, on this thread; otherwise `onExit` is never called.
  uint64_t watch(int pid, std::function<void(int)> onExit);
  /// Stops a watch (idempotent). After it returns the callback is not running and will not run.
  void unwatch(uint64_t id);

 private:
  ProcessService();
  void run();
  void acceptConnections();
  void readHello(size_t index);
  void wake();

  struct Pending {  // a connection whose Hello has not fully arrived
    posix::Fd socket;
    std::vector<uint8_t> bytes;
    int peerPid = 0;
    Clock::time_point deadline;
  };
  struct Expectation {  // a leader waiting for members
    handshake::Secret secret;
    int size = 0;
    std::deque<Arrival> arrived;
  };
  struct Watch {
    int pid = 0;
    std::function<void(int)> onExit;
  };
  // One pidfd per watched process, however many watches (communicators) share it: a job
  // that keeps many groups alive would otherwise spend a descriptor per group and peer.
  struct Watched {
    posix::Fd pidfd;
    int watches = 0;
    uint64_t generation = 0;  // tells this pidfd from a later one of the same pid
  };

  std::string address_;
  posix::Fd listener_;
  posix::Fd wakeFd_;
  std::mutex mutex_;
  std::condition_variable arrived_;
  std::vector<Pending> pending_;                 // service thread only
  std::map<CommId, Expectation> expected_;       // guarded by mutex_
  std::map<CommId, std::deque<Arrival>> early_;  // arrived before their leader asked; mutex_
  std::map<uint64_t, Watch> watches_;            // guarded by mutex_
  std::map<int, Watched> watched_;               // by pid; guarded by mutex_
  uint64_t nextWatch_ = 1;
  uint64_t nextGeneration_ = 1;  // mutex_
  uint64_t firing_ = 0;          // watch whose callback runs now; mutex_
  std::condition_variable fired_;
  // Communicators this process has finished leading (mutex_), the latest kRememberCompleted
  // in completedOrder_'s order: a later Hello for one of them is refused at once instead of
  // being parked in early_ for a leader that will never ask. Bounded, for jobs that make
  // groups without end; one older than that is parked (early_ is bounded too) until its
  // socket closes.
  static constexpr size_t kRememberCompleted = 4096;
  std::set<CommId> completed_;
  std::deque<CommId> completedOrder_;
  // Communicators this process's leader abandoned, with why (mutex_), bounded as above.
  std::map<CommId, std::string> abandoned_;
  std::deque<CommId> abandonedOrder_;
  void abandonLocked(const CommId& comm, const std::string& reason);  // mutex_ held
  std::thread thread_;
};

}  // namespace loom
