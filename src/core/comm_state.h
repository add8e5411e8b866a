#pragma once

// The state behind a Communicator handle: membership, this host's shared segment, the
// collective worker, the point-to-point engine (started on first use) and the peer watches.
//
// Creation is the same for every communicator once the roster is known: on each host, the
// lowest rank (the host's leader) creates the host's segment and hands its fd to the host's
// other ranks over the process service's socket; they map it; every rank then watches the
// processes of its host's ranks. A communicator that spans hosts also registers with the
// process's NetService, so its ranks on other hosts can connect. A top-level communicator
// gets its roster from the store; a child (split, subset) derives it from its parent's, so
// making one costs a few local socket round trips and no store traffic.

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "algorithms/across_hosts.h"
#include "algorithms/collective.h"
#include "core/bootstrap.h"
#include "core/config.h"
#include "core/control_plane.h"
#include "core/device_executor.h"
#include "core/failure_domain.h"
#include "core/op_state.h"
#include "loom/communicator.h"
#include "transport/message_link.h"
#include "transport/shm/shm_comm.h"
#include "util/worker.h"

namespace loom {

class P2pEngine;

namespace detail {

class CommState final : public FailureSink {
 public:
  /// Joins a top-level communicator through the store.
  static std::shared_ptr<CommState> createFromStore(int rank, int size, Store& store,
                                                    const CommOptions& options);
  /// Joins the child of `parent` whose members are the parent ranks `members` (new rank =
  /// index). `salt` tells apart children with the same members; members pass the same.
  /// `watchParent`: the parent's failure while the child is made ends the making (split and
  /// subset: a member aborted the parent instead of joining); not for a shrink, which
  /// starts from a parent failed or about to fail for the very ranks it leaves out.
  static std::shared_ptr<CommState> createChild(CommState& parent, const std::vector<int>& members,
                                                const std::string& salt, const CommOptions& options,
                                                bool watchParent);
  ~CommState();
  CommState(const CommState&) = delete;
  CommState& operator=(const CommState&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  uint64_t lastSequence() const { return seq_.load(std::memory_order_relaxed); }
  void setTimeout(std::chrono::milliseconds timeout) { timeoutMs_.store(timeout.count()); }
  std::chrono::milliseconds timeoutFor(const OpOptions& options) const;

  /// Queues a collective (arguments already validated).
  Request submit(CollectiveArgs args, const OpOptions& options);
  Request send(const void* data, size_t bytes, int peer, int tag, const OpOptions& options);
  Request recv(void* data, size_t bytes, int peer, int tag, const OpOptions& options);
  /// Device sends and receives issued until the matching endGroup are held and queued
  /// together there (they progress together); groups nest.
  void startGroup();
  void endGroup();
  /// Makes the executor for `device` memory now (see Communicator::connectDevice).
  void connectDevice(DeviceKind device, int deviceIndex);

  /// Counts children made with `key` so far (split and subset salts).
  int nextChildNumber(const std::string& key);

  void abort();
  /// Waits for the collectives and sends issued so far (sends to their deadlines, or
  /// kShutdownSendGrace, at the latest), fails the receives still pending, then stops every
  /// thread. Throws
  /// Error(kInvalidArgument) on one of those threads (a completion callback), which would wait for
  /// itself.
  void shutdown();

  /// Throws Error(kAborted) naming `op` if shut down, or the recorded failure if failed;
  /// Error(kUnsupported) in a process forked from the one that made this communicator.
  void requireUsable(std::string_view op);
  /// Whether `e` is this communicator's recorded failure, as a split or subset of it that
  /// stops for that failure throws it (its message names this communicator's ranks).
  bool isItsFailure(const Error& e) const {
    return failures_ && failures_->failed() &&
           failures_->failureError(e.op()).detail() == e.detail();
  }
  /// requireUsable, except that a failed communicator whose failure spares `members`
  /// (Failures::spares) passes: what a subset of them needs (it uses the parent's roster,
  /// not its segment).
  void requireMembersUsable(std::span<const int> members, std::string_view op);
  /// Throws Error(kAborted) naming `op` if shut down (requireUsable's first check alone).
  void refuseIfShutDown(std::string_view op) const;
  /// Throws Error(kUnsupported) naming `op` in a process forked from the one that made this
  /// communicator (requireUsable's fork check alone: a shrink works on a failed one).
  void refuseInAFork(std::string_view op) const;

  /// A table of what every rank of this communicator last started and finished, read from
  /// shared memory (so it shows the other ranks too).
  std::string progressReport() const;
  /// Prints the failure report (once per communicator) when an operation fails with a
  /// timeout, a dead peer or a mismatch.
  void operationFailed(const std::exception_ptr& failure) override;

 private:
  CommState(int rank, const Roster& roster, const CommOptions& options, Config config);
  /// The shared_ptr's deleter: deletes `state`, on another thread if called on one of its own.
  static void destroy(CommState* state);
  /// Whether the calling thread is one of this communicator's own: its worker, its
  /// point-to-point thread or its CUDA monitor.
  bool onOwnThread();
  /// Whether this thread is this communicator's CUDA monitor, running its calls' callbacks.
  bool onCudaMonitor() const;
  /// The parent a child (split, subset) is made from, watched while the child's members
  /// meet: a failure of it that does not spare them (Failures::spares: one of them died,
  /// left or aborted it) ends the wait at once, with the parent's reason.
  struct ParentWatch {
    const Failures* failures = nullptr;
    std::vector<int> members;  // the child's ranks, as the parent numbers them
    bool stops() const {
      return failures != nullptr && failures->failed() && !failures->spares(members);
    }
  };
  /// Joins the communicator's host segment and starts its threads; `child`: made from a
  /// parent (split, subset, shrink), not through a store, and watching `parent`.
  void join(std::chrono::steady_clock::time_point deadline, bool child, const ParentWatch& parent);
  /// This host's segment as joinSegment leaves it; `broken`, where members were handed the
  /// segment but not all of them took it: the rank to blame and why, which join records in
  /// the segment, so that the members that did take it fail at once rather than wait.
  struct JoinedSegment {
    std::shared_ptr<shm::Segment> segment;
    std::optional<std::pair<int, std::string>> broken;
  };
  /// Makes (the host's lowest rank) or receives this host's segment.
  JoinedSegment joinSegment(std::chrono::steady_clock::time_point deadline, bool child,
                            const ParentWatch& parent);
  /// Where every rank runs, as rank `rank` sees it (for collectives across hosts).
  static HostLayout layoutOf(const HostMap& hosts, int rank);
  /// Starts this rail rank's control plane and waits until the other hosts have met it.
  void startControlPlane(std::chrono::steady_clock::time_point deadline);
  /// Waits for `request` without throwing (for the blocking form of a call).
  static void settle(const Request& request);
  /// The executor of collectives on `options.device` memory, made on first use (a
  /// collective step over this host's ranks).
  DeviceExecutor& deviceExecutor(const OpOptions& options, std::string_view op);
  /// Runs one collective to completion on this thread (the worker's, or a blocking caller's),
  /// starting at `start` (its deadline runs from there).
  void execute(const CollectiveArgs& args, OpState& state, std::chrono::milliseconds timeout,
               std::chrono::steady_clock::time_point start);
  /// What a collective `op` that threw `error` on this rank ends with: `error` itself where
  /// it is the communicator's recorded failure, else that failure, recorded now for every rank
  /// (the collective stopped between phases its peers still wait for).
  std::exception_ptr brokeOff(std::string_view op, std::exception_ptr error);
  /// The worker's hold watch found calls waiting behind a completion callback for the
  /// communicator's timeout (util/worker.h): fails the communicator with the reason.
  void queueHeld(const Worker::Hold& hold);
  /// What call `seq`, an `op` given up by a hold, ends with.
  std::exception_ptr heldError(std::string_view op, uint64_t seq);
  /// A send or receive of device memory: queued now, or held until the group ends.
  /// Device transfers ended without being queued (a group refused, or shut down open):
  /// their requests are marked ended at once, and their callbacks run by settle() once the
  /// group's lock and posting are let go, all of them after every one ended (a callback may
  /// wait on another of them, start a group or drop the communicator).
  struct EndedUnqueued {
    struct Ended {
      std::shared_ptr<OpState> state;
      std::exception_ptr failure;
      OpState::Callbacks callbacks;
    };
    std::vector<Ended> ended;
    std::exception_ptr thrown;  ///< what the caller's call throws once they ran, if anything
    /// Marks `state` ended with `failure` now.
    void end(std::shared_ptr<OpState> state, std::exception_ptr failure);
    /// Runs the callbacks, then throws `thrown` if set.
    void settle();
  };
  /// `refused`: a group it ended without queueing it (settle() it once posting is over).
  Request deviceTransfer(const Transfer& transfer, const OpOptions& options, uint64_t flightId,
                         EndedUnqueued& refused);
  /// A send or receive: checked and posted while shutdown cannot take the engine away
  /// (Posting), then, if blocking, waited for.
  Request transfer(const Transfer& t, const OpOptions& options);
  /// Queues the held transfers (under groupMutex_), or ends their requests failed in
  /// `refused`.
  void flushGroup(EndedUnqueued& refused);
  void watchPeers();
  P2pEngine& p2p();
  /// The link to rank q for point-to-point traffic (channel 0) or collectives (channel 1):
  /// shared-memory rings (point-to-point only) or the network.
  std::unique_ptr<MessageLink> linkTo(int q, uint32_t channel);
  /// Runs a collective whose ranks span hosts (on the worker thread).
  void executeAcrossHosts(const CollectiveArgs& args, const WaitSpec& wait, uint64_t seq);
  bool spansHosts() const { return hosts_.hosts() > 1; }
  /// The lanes of this communicator's collectives across hosts.
  int netLanes() const { return config_.netLanes; }

  const int rank_;
  const int size_;
  const std::string name_;
  const std::string rankLegend_;  // CommOptions::rankLegend
  const Roster roster_;
  const HostMap hosts_;
  const Config config_;
  // The process that made this communicator. A fork of it inherits the memory but not the
  // threads, and shares the segment and the connections with it: there, the communicator
  // refuses every call, and abort, shutdown and destruction touch nothing peers can see and
  // join no thread (forkedAway()).
  const pid_t owner_;
  bool forkedAway() const;
  std::atomic<int64_t> timeoutMs_;

  std::unique_ptr<shm::ShmComm> shm_;
  std::unique_ptr<FailureDomain> failures_;
  std::atomic<uint64_t> seq_{0};
  uint64_t phase_ = 0;  // worker thread only
  std::vector<uint64_t> watches_;
  std::atomic<bool> shutDown_{false};
  // Its shutdown has ended: this rank has left, and an abort now (from another thread, as
  // the shutdown ends) must not fail its peers' copies, which go on without it. Set with
  // the departure under leaving_, which abort() holds from its check to its failure: an
  // abort that passed the check before the departure would otherwise write its failure after.
  std::mutex leaving_;
  bool departed_ = false;  // guarded by leaving_

  std::mutex childMutex_;
  std::map<std::string, int> childCounts_;  // guarded by childMutex_

  std::mutex p2pMutex_;
  std::unique_ptr<P2pEngine> p2p_;  // created on first send/recv; guarded by p2pMutex_
  // Sends, receives and CUDA calls between their check (requireUsable) and their post on
  // the engine or the device executor: shutdown takes those away only once none is, and one
  // that begins later sees it shut down (Posting, comm_state.cc).
  std::atomic<int> posting_{0};
  class Posting;

  HostLayout layout_;                      // where the ranks run, for collectives across hosts
  std::unique_ptr<ControlPlane> control_;  // rail ranks of a communicator spanning hosts
  ScratchArena scratch_;                   // worker thread only: collectives across hosts
  // The lanes of collectives across hosts (algorithms/network_context.h): each one's links,
  // made lazily by the collective's thread and driven by it and, during its collectives, by
  // the lane's rail and send threads, which are idle between collectives.
  struct Lane {
    std::vector<std::unique_ptr<MessageLink>> links;  // by rank; lane 0's also the worker's
    ScratchArena railScratch;
    std::unique_ptr<Worker> sends;  // threads: destroyed before the links they drive
    std::unique_ptr<Worker> rail;
  };
  std::vector<std::unique_ptr<Lane>> lanes_;  // worker thread only

  std::mutex deviceMutex_;
  std::unique_ptr<DeviceExecutor> cuda_;  // CUDA collectives; guarded by deviceMutex_
  // cuda_'s mark on the thread that completes its calls (op_state.h, markCompleting), read
  // without the lock: that thread's callbacks ask onOwnThread while a shutdown holding
  // deviceMutex_ waits for them.
  std::atomic<const void*> cudaCompleter_{nullptr};
  // Why setting up the CUDA path failed, once it has: later CUDA calls fail with it at once
  // rather than setting up again (every rank must take part in a set-up, and the host's
  // ranks would not all be there); guarded by deviceMutex_.
  std::optional<Error> cudaSetupFailure_;

  // Device transfers held in an open group (startGroup/endGroup).
  struct HeldTransfer {
    Transfer transfer;
    std::shared_ptr<OpState> state;
    OpOptions options;
  };
  std::mutex groupMutex_;
  int groupDepth_ = 0;                    // guarded by groupMutex_
  std::vector<HeldTransfer> held_;        // guarded by groupMutex_
  std::vector<uint64_t> deviceMessages_;  // by peer: device transfers issued (groupMutex_)

  std::mutex heldMutex_;
  std::string heldReason_;  // why a hold failed the communicator (queueHeld); heldMutex_

  std::unique_ptr<Worker> worker_;  // last: destroyed (drained) first

  friend class ::loom::Communicator;
};

}  // namespace detail
}  // namespace loom
