#pragma once

// This process's side of incoming network connections. One thread accepts every connection
// on the Fabric's listener, drives its handshake, and files the proven ReceiveChannel under
// the traffic it carries (communicator, sender, receiver, channel) until the communicator's
// link claims it. A connection for a communicator this process has not registered yet is
// held (a peer may be faster to make a child communicator) until `unexpectedHold`; one that
// has not completed its handshake within `handshake` is dropped, and at most `maxPending`
// wait at once (fewer where a quarter of the open-file limit holds fewer), so strangers
// cost little and nothing lasts.

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "transport/net/channel.h"
#include "transport/net/fabric.h"

namespace loom::net {

class NetService {
 public:
  struct Limits {
    std::chrono::milliseconds handshake{10'000};       ///< to prove the secret, once known
    std::chrono::milliseconds unexpectedHold{60'000};  ///< to wait for its communicator
    /// Connections not yet proven, at most (and no more than a quarter of the process's
    /// open-file limit holds: each holds several descriptors).
    size_t maxPending = 256;
    /// With every slot taken: how long one may go unproven before it is closed to make room
    /// for the next; those that wait for their communicator (a member whose process
    /// registers late looks like that) go only where no silent one is past this, and those
    /// in their handshake for a known communicator never (their own limit ends them).
    std::chrono::milliseconds crowdedHold{2'000};
  };

  /// The process's service over Fabric::instance(), started on first use.
  static NetService& instance();
  explicit NetService(Fabric& fabric, Limits limits);
  /// Stops the thread; channels not claimed are closed.
  ~NetService();
  /// Stops the thread (at exit for the process's service; its object lives on).
  void stop();
  NetService(const NetService&) = delete;
  NetService& operator=(const NetService&) = delete;

  /// Where peers connect ("address:port").
  const std::string& address() const { return fabric_.address(); }

  /// The window of each channel of a communicator (both ends must agree).
  using ShapeOf = std::function<ChannelShape(uint32_t channel)>;
  /// Accepts connections for communicator `comm` whose initiators prove `secret`, with
  /// windows of shapeOf(channel). Each call counts one user of `comm` in this process (its
  /// ranks may be threads of it); forget() gives one back.
  void expect(const CommId& comm, const JobSecret& secret, ShapeOf shapeOf);
  /// The same with one window for every channel.
  void expect(const CommId& comm, const JobSecret& secret, ChannelShape shape) {
    expect(comm, secret, [shape](uint32_t) { return shape; });
  }
  /// Rank `receiver` of `comm` leaves: closes the proven channels to it nobody claimed, turns
  /// away connections to it from now on (for the hold limits: its peers learn of its
  /// departure a little later), and once no user of `comm` is left here, stops accepting for
  /// it and closes the rest.
  void forget(const CommId& comm, int receiver);
  /// The proven channel carrying `sender` -> `receiver` on `channel` of `comm`, or nullptr if
  /// it has not arrived yet. Each is handed out once.
  std::unique_ptr<ReceiveChannel> claim(const CommId& comm, int sender, int receiver,
                                        uint32_t channel);
  /// A proven channel of `comm` to `receiver` from any sender, on a channel `accepted` takes,
  /// or nullptr: for a service that learns its peers as they come (its announced() says who).
  std::unique_ptr<ReceiveChannel> claimAny(const CommId& comm, int receiver,
                                           bool (*accepted)(uint32_t channel));

  /// Closes the channel `sender` -> `receiver` on `channel` of `comm` if it is here, or as
  /// it arrives within the handshake and hold limits: for one its receiver gave up on before
  /// claiming it (it would otherwise stay filed, with its window, until `comm` is forgotten).
  void discard(const CommId& comm, int sender, int receiver, uint32_t channel);

  /// Connections refused or dropped so far (for tests and reports).
  uint64_t refused() const { return refused_.load(std::memory_order_relaxed); }
  /// How many communicators it accepts connections for now (for tests).
  size_t expecting() {
    std::lock_guard<std::mutex> lock(mutex_);
    return expected_.size();
  }

 private:
  using Clock = std::chrono::steady_clock;
  using Key = std::tuple<CommId, int, int, uint32_t>;
  struct Pending {
    std::unique_ptr<ReceiveChannel> channel;
    Clock::time_point since;  ///< accepted, or found its communicator
    bool waited = false;      ///< was waiting for its communicator
  };

  void run();
  void advance(Clock::time_point now);
  // Every slot taken: closes the connection that has said nothing longest, if past
  // crowdedHold, or else the one waiting for its communicator longest, if past it; never
  // one in its handshake for a known communicator.
  void makeRoom(Clock::time_point now);
  // Accepting failed with `e`: where this process ran short (kSystem), closes at once the
  // connection waiting longest that has said nothing, or else waits for its communicator.
  void makeRoomForShortage(const Error& e);
  // Closes pending connection `i` unproven (counted as refused).
  void closePending(size_t i);
  /// What a Hello's traffic needs, nullopt while its communicator is not registered here;
  /// throws for a receiver that has left (forget), which turns the connection away.
  std::optional<Expectation> lookup(const Hello& hello);
  /// Whether `receiver` of `comm` has left within the hold limits (mutex_ held).
  bool departedNow(const CommId& comm, int receiver);
  /// Says on stderr why a connection could not be taken, where that is this process's fault
  /// (at most every 10 s).
  void reportRefusal(const Error& e);

  Fabric& fabric_;
  const Limits limits_;
  std::mutex mutex_;
  struct Expected {
    JobSecret secret{};
    ShapeOf shapeOf;
    int users = 0;  ///< expect() calls not yet forgotten
  };
  std::map<CommId, Expected> expected_;                           // guarded by mutex_
  std::map<Key, std::unique_ptr<ReceiveChannel>> proven_;         // guarded by mutex_
  std::map<Key, Clock::time_point> discarded_;                    // guarded by mutex_: until when
  std::map<std::pair<CommId, int>, Clock::time_point> departed_;  // guarded by mutex_: ditto
  std::vector<Pending> pending_;                                  // service thread only
  Clock::time_point lastReport_{};                                // service thread only
  std::atomic<uint64_t> refused_{0};
  std::atomic<bool> stopping_{false};
  const pid_t owner_;  // the process whose thread thread_ is
  std::thread thread_;
};

}  // namespace loom::net
