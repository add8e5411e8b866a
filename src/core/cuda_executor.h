#pragma once

// Collectives and point-to-point transfers on CUDA memory among the ranks of one host, as
// work on the caller's stream with no host round trip per step.
//
// Each rank owns a device workspace (cuMem, exported as a file descriptor and mapped by
// every rank of the host): a page of flags, collective slots of two halves (chunk bytes
// each; four, of which stepped calls use two), and a mailbox per sending peer (two slots of
// a chunk); and two slots and mailboxes (of quarter-chunk slots) for operations captured in
// CUDA graphs (below).
//
// A collective runs in steps of at most one chunk per rank; step e uses slot e % 2 and the
// flags of parity e % 2. In a step each rank copies its share into its slot, raises its
// flag to e, makes its stream wait until its peers' flags reach e (cuStreamBatchMemOp: the
// wait is done by the GPU's front end, not a spinning kernel, so ranks that share one GPU
// and are time-sliced by it never burn a peer's turn), then reduces or copies out of the
// peers' slots. A slot is refilled only after every peer has said it is done with it
// ("done" flag >= e - 2). Results are bit-identical across ranks: every rank reduces in
// rank order.
//
// Where every rank has a GPU of its own, an eager call of several steps runs its odd steps on a
// second stream (forked from the caller's and joined back at the end): each parity's steps
// are a chain of the protocol above on slots and flags of their own, so while one stream
// waits for its peers' flags the other moves bytes, and one step's copy into the slot (local
// memory) overlaps the other's reads from peers (NVLink). Measured with torch's profiler on
// two H100s, a single stream left the GPU without a kernel for about 20 us per all_reduce
// step (docs/PERFORMANCE.md, "Where a large call's time goes").
//
// Where every rank has a GPU of its own, an eager all_reduce that every rank reduces whole
// (one-shot), all_gather, reduce_scatter and all_to_all with equal parts, and broadcast run
// as one fused kernel each instead of steps queued from the host (cuda::FusedParams): its
// pushing blocks write this rank's parts into its peers' slots over NVLink while its
// receiving blocks reduce or copy out what the peers pushed here, with flags per block
// that the peers write into this rank's workspace (so every wait polls local memory) and a
// cooperative launch (a block may wait for another of its own grid). A large broadcast
// travels a chain instead (each rank takes it from the one before and passes it on, one
// sender and one receiver per GPU), and a large all_reduce goes around a ring the same way
// (each share gathers every rank's part on its way round, then goes round once more
// finished). Spinning waits suit a GPU per rank only; ranks sharing a
// GPU keep the stepped path.
//
// A transfer moves in chunks through the receiver's mailbox for the sender: the sender
// writes chunk k into slot k % 2 once the receiver has taken chunk k - 2, and raises its
// "sent" flag for that peer; the receiver waits for it, copies out and raises "taken". The
// transfers of one call advance a chunk per peer per round, so a ring of sends and
// receives in one call cannot deadlock. Where every rank has a GPU of its own, an eager
// call's transfers run as one fused kernel instead (cuda::TransferParams): the same chunks
// and mailboxes, with a "sent" and a "taken" count per block of each pair, so every slice
// of a chunk moves as soon as its own slice of the chunk two before is taken, and every
// pair's traffic flows at once, with no round of stream waits per chunk.
//
// Operations captured in a CUDA graph run at every replay, at a point the host never sees,
// so they cannot carry epochs or chunk numbers counted by the host. They have a lane of their
// own (flags, descriptors, slots, pair blocks and mailboxes apart from the eager lane's):
// their steps number from an epoch in device memory, and each pair's chunks from a sent and
// a taken count in device memory, which each rank's stream advances after every captured
// operation; their flag waits and writes are a one-thread kernel (loom_flags) reading those
// counters. Ranks replay the same graphs in the same order, so their counters agree as the
// host's do. A rank that captures a call its peers issue eagerly (or the reverse) waits in
// the other lane: that is a timeout, not a named mismatch.
//
// Calls may come on different streams (the caller's own for a blocking call, a loom stream
// for an asynchronous one): a call on another stream than the last of its lane waits for
// that one, so every rank's calls run on its GPU in the order they were numbered (within a
// capture too). Replays of different graphs are ordered by the caller, as with NCCL: replay
// them on one stream, or make their streams wait for each other.
//
// Every operation's first step checks agreement: each rank publishes what it is doing (a
// descriptor: kind, dtype, op, root, sizes; a transfer's tag and size) and the kernel that
// first reads a peer's data compares the peer's descriptor with its own (in a rooted call
// every non-root checks the root's, also where it reads nothing). Ranks that issued
// different operations get kMismatch naming both, never a wrong answer.
//
// A monitor thread completes requests when their events fire, and enforces deadlines (of
// eager calls; a replay has none) and failures: when the communicator fails (a dead rank, a
// timeout, an abort, a mismatch) it sets the abort word the kernels check and raises every flag of
// every workspace past any epoch, so no stream stays blocked on a peer and the GPU is usable
// afterwards.

#include <cuda.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/config.h"
#include "core/cuda_fused_trace.h"
#include "core/cuda_paths.h"
#include "core/cuda_workspace.h"
#include "core/device_executor.h"
#include "core/failure_domain.h"
#include "core/fd_exchange.h"
#include "cuda/kernels.h"
#include "cuda/shared_memory.h"

namespace loom::detail {

class CudaExecutor final : public DeviceExecutor {
 public:
  /// Joins the host's CUDA workspace exchange (collective over the ranks of this host,
  /// which must be the whole communicator) for buffers on device `device`.
  CudaExecutor(int device, const CudaTuning& tuning, FdExchange exchange, FailureDomain& failures,
               std::chrono::steady_clock::time_point deadline);
  ~CudaExecutor() override;

  void enqueue(const CollectiveArgs& args, const std::shared_ptr<OpState>& state,
               const OpOptions& options, std::chrono::milliseconds timeout) override;
  void enqueueTransfers(std::span<const Transfer> transfers,
                        std::span<const std::shared_ptr<OpState>> states, const OpOptions& options,
                        std::chrono::milliseconds timeout) override;

  /// The device ordinal the workspaces live on.
  int device() const { return device_; }

 private:
  // A rank's flags, each written by that rank only (see the layout in cuda_workspace.h).
  enum Flag : int { kReady = 0, kReduced = 1, kDone = 2 };
  enum PairFlag : int { kSent = 0, kTaken = 1 };
  struct Pending {
    CUevent event;
    std::vector<std::shared_ptr<OpState>> states;
    std::chrono::steady_clock::time_point deadline;
    std::string op;
    uint64_t firstStep = 0;  // its first collective step in the eager lane; 0: none
    // For a call with sends or receives: the eager lane's chunk counts once it is queued
    // (empty otherwise), which are what this rank has done once it has finished.
    std::vector<uint64_t> sentAfter;
    std::vector<uint64_t> takenAfter;
  };
  // The segments of one step's copies, and the sources of its reductions.
  struct Segments;
  struct Sources;
  // Where one kind of operation keeps its flags, descriptors, slots, pair blocks and
  // mailboxes (offsets into every workspace), and how it numbers its steps and chunks:
  // eager operations from epoch, sent and taken, on the host; captured ones (onDevice) from
  // counters in device memory, the host's counting only the call being captured.
  // A lane's calls may come on different streams (the caller's own for a blocking call, a
  // loom stream for an asynchronous one): a call on another stream than the lane's last
  // call waits for that call's collective steps (`lastEnd`), so every rank runs a lane's
  // calls in the order they were numbered. Streams are told apart by ID (a handle may be
  // reused), in the graph lane by handle and only within one capture (a capturing stream
  // has no ID to give, and an event recorded in one capture cannot be waited for in
  // another).
  struct Lane {
    Lane(size_t flags, size_t oddFlags, size_t descriptors, size_t slots, size_t pairs,
         size_t mailboxes, size_t slot, bool device, int peers)
        : flagsAt(flags),
          oddFlagsAt(oddFlags),
          descriptorsAt(descriptors),
          slotsAt(slots),
          pairsAt(pairs),
          mailboxesAt(mailboxes),
          mailSlot(slot),
          onDevice(device),
          sent(static_cast<size_t>(peers)),
          taken(static_cast<size_t>(peers)) {}
    size_t flagsAt;        // the ready/reduced/done lines of even epochs
    size_t oddFlagsAt;     // and of odd epochs
    size_t descriptorsAt;  // two collective descriptors, by epoch parity
    size_t slotsAt;        // slots of two halves, chunk bytes each (cuda_workspace.h)
    size_t pairsAt;        // a pair block per peer
    size_t mailboxesAt;    // two mailbox slots per sending peer
    size_t mailSlot;       // bytes per mailbox slot
    bool onDevice;
    uint64_t epoch = 0;
    std::vector<uint64_t> sent;   // by peer: chunks sent to it
    std::vector<uint64_t> taken;  // by peer: chunks taken from it
    CUevent lastEnd = nullptr;
    std::optional<unsigned long long> lastStream;
    unsigned long long lastCapture = 0;  // graph lane: the capture lastEnd was recorded in
  };
  // A flag wait (flag >= *base + offset) or write (flag = *base + offset); in the eager lane
  // base is null and offset the absolute value. The graph lane's bases are device counters
  // (its epoch, or a pair's sent or taken count).
  struct FlagStep {
    uint8_t* flag;
    const uint64_t* base;
    uint64_t offset;
    bool wait;
  };

  /// Checks, locks and fills the stream for one call (`fill` queues its steps), then
  /// hands its requests to the monitor.
  template <class Fill>
  void queue(const std::string& op, std::span<const std::shared_ptr<OpState>> states,
             const OpOptions& options, std::chrono::milliseconds timeout, Fill&& fill);
  /// After a captured call: advances the device counters past its steps and chunks, each
  /// to an even count, so that every captured call starts on slot 1 of each, as the host
  /// assumed when capturing it.
  void finishCapturedCall();

  // The steps collectives are made of (on the stream being filled).
  uint64_t beginStep();
  /// Runs `body(lo, e)` for each step of `perStep` elements of `count` (at least one step,
  /// so every call is checked), each in its own epoch e; odd steps on the second stream
  /// when paths_.pipelined.
  template <class Body>
  void steps(size_t count, size_t perStep, Body&& body);
  /// Queues `main()` on stream_ and `side()` on the second stream beside it, both after
  /// what stream_ held before, then makes stream_ wait for both (eager calls only: see
  /// steps() on streams forked in a capture).
  template <class Main, class Side>
  void alongside(Main&& main, Side&& side);
  void signal(Flag which, uint64_t epoch);
  void await(Flag which, uint64_t epoch, int only = -1);  // every peer, or just `only`
  /// Queues flag waits and writes (at most kMaxSources), in order, as one batch: stream
  /// memory operations in the eager lane, loom_flags in the graph lane (then the advances
  /// of device counters, graph lane only).
  void queueFlagSteps(std::span<const FlagStep> steps,
                      std::span<const cuda::Advance> advances = {});
  /// The device counters of the graph lane (nullptr in the eager lane): its epoch, and the
  /// chunks sent to and taken from `peer`.
  uint64_t* epochBase() const;
  uint64_t* sentBase(int peer) const;
  uint64_t* takenBase(int peer) const;
  /// What a launch in step `epoch` checks: this rank publishes its descriptor (`publish`)
  /// or expects its peers' (every peer, or `only`); nothing after an operation's first step.
  cuda::Agreement publishing(uint64_t epoch);
  cuda::Agreement expecting(uint64_t epoch, int only = -1);
  cuda::Agreement noAgreement();
  /// What a round of a transfer checks, its entries added by the caller: with the pair
  /// counts a replay numbers its chunks from (cuda::Agreement::pairCounts).
  cuda::Agreement transferAgreement();
  /// Whether the call being filled may run as one fused kernel: its sends and receives
  /// (cuda::TransferParams), and a collective whose largest buffer on this rank is `largest`
  /// bytes (cuda::FusedParams).
  bool fusableTransfers() const;
  bool fusable(size_t largest) const;
  /// Every rank but this one, as bits.
  uint32_t everyPeer() const;
  /// Runs the call as one fused kernel: `p` has what moves (parts, bits, count in units of
  /// `elementBytes`); this adds the steps and the workspace. A reduction with `reduction`'s
  /// type and op, else a copy (counts in bytes).
  void runFused(cuda::FusedParams& p, size_t elementBytes, const CollectiveArgs* reduction);
  void copy(std::span<const cuda::Segment> segments, const cuda::Agreement& agreement);
  void copy(std::initializer_list<cuda::Segment> segments, const cuda::Agreement& agreement);
  void reduce(void* dst, const Sources& srcs, size_t count, const CollectiveArgs& args,
              const cuda::Agreement& agreement);
  /// Rank q's collective flag `which` for steps of `epoch`'s parity in the lane being filled.
  uint8_t* flag(int q, Flag which, uint64_t epoch) const;
  /// Makes the second stream wait for the work queued so far on stream_, and stream_ for
  /// all the second stream's work (the two ends of a pipelined call).
  void fork();
  void join();
  /// join() on a call that is failing anyway: the caller's stream must still wait for what
  /// the second stream has queued before its tensors may be reused, but the driver error
  /// that failed the call is the one to report.
  void joinAfterFailure() noexcept;
  /// After a call failed part-way through queueing (the communicator failed with it): what
  /// it queued may still run, writing flags and reading the workspaces, so an event behind
  /// it goes to draining_, which the monitor keeps releasing and the destructor waits for.
  void drainQueuedPart() noexcept;
  // Slot addresses: rank q's input half and reduced half of the slot for `epoch`.
  uint8_t* in(int q, uint64_t epoch) const;
  uint8_t* reduced(int q, uint64_t epoch) const;
  /// Rank `owner`'s flags about its peer `peer` (PairFlag lines, then chunk descriptors).
  uint8_t* pair(int owner, int peer) const;
  /// The slot of `receiver`'s mailbox for `sender` that chunk number `chunk` goes through.
  uint8_t* mailbox(int receiver, int sender, uint64_t chunk) const;
  /// Rank q's descriptor of its collective step `epoch`, and `sender`'s of chunk number
  /// `chunk` it sent to `receiver`.
  cuda::Descriptor* descriptor(int q, uint64_t epoch) const;
  cuda::Descriptor* pairDescriptor(int sender, int receiver, uint64_t chunk) const;

  /// A reduction on a communicator of one rank: the op applied to its own input alone
  /// (PREMUL_SUM still scales), with no peer to agree with.
  void reduceAlone(const void* input, void* output, size_t count, const CollectiveArgs& args);
  /// In a rooted call's first step `e`, where this rank takes nothing from the peers it must
  /// agree with, once they say they are there: checks `only` (a reduce's or gather's
  /// non-root: its root), or every peer (a broadcast's or scatter's root). Otherwise ranks
  /// that all only publish would pass a mismatch unseen: a scatter's root and a gather's
  /// non-roots, or ranks that each name themselves the root of a broadcast.
  void checkPeers(uint64_t e, int only = -1);
  /// A broadcast's or scatter's non-root: in the first step `e` publishes this rank's
  /// descriptor and raises its "ready" for the root's checkPeers; then waits for the root's
  /// "ready" and copies `piece` out of its slot, checking the root in the first step.
  void takeFromRoot(const cuda::Segment& piece, int root, uint64_t e);
  void allReduce(const CollectiveArgs& args);
  void reduceToRoot(const CollectiveArgs& args);
  void broadcast(const CollectiveArgs& args);
  void allGather(const CollectiveArgs& args, bool onlyRoot);
  void reduceScatter(const CollectiveArgs& args);
  void allToAll(const CollectiveArgs& args);
  /// all_to_all with split sizes: a transfer to and from every peer, and a local copy.
  void allToAllV(const CollectiveArgs& args);
  void scatter(const CollectiveArgs& args);
  void barrier();
  /// Queues `transfers`; `purpose` goes into their descriptors (user send/recv, or the
  /// blocks of an all_to_all). Fused (one kernel) where fusableTransfers(), else in rounds of
  /// steps.
  void transfer(std::span<const Transfer> transfers, uint8_t purpose);
  /// The same as one fused kernel (cuda::TransferParams), at most
  /// cuda::kMaxTransferMessages transfers.
  void fusedTransfer(std::span<const Transfer> transfers, uint8_t purpose);

  void monitor();
  /// Why `late`, a call past its deadline, has not finished: the peers whose collective
  /// steps have not reached its first (read from their flags), or what else may hold it.
  std::string lateness(const Pending& late);
  /// Every rank's last collective step in `lane`, read from its "ready" flags (raised in the
  /// first step of every collective before any wait, fused ones included) on loom's own
  /// stream; empty if the GPU could not be read (monitor thread).
  std::vector<uint64_t> lastSteps(const Lane& lane);
  /// Fails the communicator where a peer that destroyed its communicator normally stopped
  /// short of a step this rank's kernels have begun, or of a chunk this rank sends to it or
  /// receives from it (its final counts), or a replay's flag wait on it (the graph lane's
  /// wait record): they would wait for it until their timeout, a replay of a captured call
  /// forever (monitor thread, at most once per kLeftEvery while calls are pending or graphs
  /// were captured).
  void failIfPeerLeft();
  /// A replay's flag wait, seen the same at this check and the one before, on a flag of a
  /// rank in `left` that stays below the value awaited: that rank and what waits (monitor
  /// thread).
  struct ReplayWait {
    int peer;
    const char* what;
  };
  std::optional<ReplayWait> replayWaitingOn(const std::vector<int>& left);
  /// The eager lane's send and receive chunks that departed peer `q` never took or sent
  /// (its final counts against this rank's issued ones), said for the failure; empty if
  /// none, or if its counts cannot be read (monitor thread, under pendingMutex_).
  std::string transfersLeftBy(int q);
  /// Leaves this rank's final counts in its workspace for peers that outlive it
  /// (destructor, once every call has finished).
  void leaveFinalCounts() noexcept;
  /// Turns a kernel's mismatch report into the communicator's failure (a peer's stopped
  /// kernels: once kStaleGrace has passed without that peer's own failure; monitor thread).
  void reportMismatch();
  /// Frees every stream waiting on a flag of any workspace and stops the kernels (at most
  /// once per kReleaseEvery; monitor thread, under pendingMutex_).
  void release();
  /// Hands back the events of failed calls that have left the GPU, releasing the flags
  /// again while any has not (monitor thread, under pendingMutex_).
  void drain();

  const int device_;
  const size_t chunk_;
  const int rank_;
  const int size_;
  FailureDomain& failures_;
  CUcontext context_ = nullptr;
  CUstream abortStream_ = nullptr;
  std::unique_ptr<cuda::Kernels> kernels_;
  std::unique_ptr<cuda::SharedMemory> mine_;
  std::vector<std::unique_ptr<cuda::SharedMemory>> peers_;  // by rank; [rank_] is empty
  std::vector<uint8_t*> bases_;                             // every rank's workspace here
  CudaPaths paths_;  // one-shot bytes, streams, fused or stepped (chosen once, at set-up)
  size_t fusedTwoShotBytes_ = 0;            // smallest all_reduce fused in two shots
  size_t fusedTwoShotBroadcastBytes_ = 0;   // smallest broadcast fused in two shots
  size_t fusedChainBroadcastBytes_ = 0;     // smallest broadcast fused along a chain
  size_t fusedRingAllReduceBytes_ = 0;      // smallest all_reduce fused around a ring
  int transferMostBlocks_ = 1;              // a fused transfer's most blocks per stream
  CUstream side_ = nullptr;                 // the second stream
  CUevent forked_ = nullptr;                // recorded on stream_ where the second stream starts
  CUevent joined_ = nullptr;                // recorded on side_ where it ends
  WorkspaceLayout layout_;                  // where slots, mailboxes and block flags lie
  cuda::MismatchReport* report_ = nullptr;  // host memory the kernels write (device view)
  cuda::MismatchReport* reportHost_ = nullptr;
  std::unique_ptr<CudaFusedTrace> trace_;  // LOOM_CUDA_FUSED_TRACE's record, if set

  std::mutex enqueueMutex_;    // one collective is queued at a time
  CUstream stream_ = nullptr;  // the stream being filled (under enqueueMutex_)
  Lane eager_;                 // lanes: under enqueueMutex_
  Lane graph_;
  Lane* lane_ = &eager_;                     // the lane of the call being filled
  std::atomic<bool> graphsCaptured_{false};  // any call captured: replays to wait for, release
  uint64_t firstEpoch_ = 0;                  // the first step of the call being filled
  uint64_t fusedExits_ = 0;       // fused kernel blocks launched, ever (FusedParams::exits)
  cuda::Descriptor described_{};  // what the collective being filled is (its first step)
  const double* describedFactor_ = nullptr;  // its PREMUL_SUM factor in device memory, if any
  std::vector<uint64_t> transferTable_;      // the fused transfer being filled: its table

  std::mutex pendingMutex_;
  std::condition_variable pendingChanged_;
  std::deque<Pending> pending_;  // guarded by pendingMutex_
  // The eager lane's chunks sent to and taken from each peer by the calls queued so far
  // (copies of its counts for the monitor), and by those finished; guarded by pendingMutex_.
  std::vector<uint64_t> issuedSent_;
  std::vector<uint64_t> issuedTaken_;
  std::vector<uint64_t> finishedSent_;
  std::vector<uint64_t> finishedTaken_;
  std::vector<CUevent> spareEvents_;  // recorded and finished; guarded by pendingMutex_
  bool stopping_ = false;             // guarded by pendingMutex_
  // When the monitor first read a report of a peer's stopped kernels (reportMismatch).
  std::optional<std::chrono::steady_clock::time_point> staleSince_;
  std::chrono::steady_clock::time_point leftChecked_{};  // failIfPeerLeft's last look
  std::array<uint64_t, 2> replayWaitSeen_{};             // replayWaitingOn's last record
  std::deque<CUevent> draining_;  // of calls failed before they ran; guarded by pendingMutex_
  std::chrono::steady_clock::time_point lastRelease_;  // release()'s last; monitor thread
  std::chrono::milliseconds graphRelease_{10};  // failed, graphs captured: next release after
  std::thread monitor_;
};

}  // namespace loom::detail
