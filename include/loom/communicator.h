#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "loom/request.h"
#include "loom/store.h"
#include "loom/types.h"

namespace loom {

namespace detail {
class CommState;
}

/// How a communicator is made.
struct CommOptions {
  /// Deadline for every operation that is not given its own.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  /// A label for messages and the operation record ("default_pg", "tp", ...).
  std::string name = "world";
  /// What this communicator's rank numbers are in the caller's terms, where they differ
  /// ("ranks of process group 'tp'; its ranks 0 to 1 are global ranks 4, 5"); the failure
  /// report on stderr quotes it. Empty: the caller numbers ranks as the communicator does.
  std::string rankLegend;
};

/// Per-call options.
struct OpOptions {
  /// This call's deadline; zero means the communicator's.
  std::chrono::milliseconds timeout{0};
  /// The blocking form: the call returns only once the operation has finished (the Request
  /// is complete; wait() then reports its outcome). When nothing else is queued on the
  /// communicator the operation runs on the calling thread, with no hand-off to the worker
  /// and no second thread spinning while it waits: the cheapest way to run one collective.
  bool blocking = false;
  /// Desync debug: the caller's description of what must agree beyond loom's own checks
  /// (the torch plugin puts tensor shapes here when LOOM_DESYNC_DEBUG=1). Ranks whose
  /// signatures differ at the same collective fail with kMismatch quoting both (up to 127
  /// characters each). Empty: not checked. Collectives only.
  std::string signature;
  /// Where the buffers live: host memory (the default) or CUDA device memory. Collectives
  /// only; CUDA buffers need every rank of the communicator on one host.
  DeviceKind device = DeviceKind::kCpu;
  /// kCuda: the device ordinal of the buffers (this rank's GPU; the same on every call).
  int deviceIndex = 0;
  /// kCuda: the CUstream to queue the collective on. It runs after the work queued there
  /// before the call, and work queued after it sees its results; the call does not wait
  /// for the GPU, and the Request completes once the GPU has run it. Buffers must stay
  /// valid until then (as for any stream work).
  void* stream = nullptr;
};

/// Receive from whichever rank sends first.
inline constexpr int kAnySource = -1;

/// A group of ranks that run collectives together. Made from (rank, size, store), or
/// derived from another communicator (split, subset) without touching the store.
///
/// Every operation is non-blocking and returns a Request; operations on one communicator
/// run one after another in issue order on its worker thread, so several may be queued.
/// OpOptions::blocking gives the blocking form of any call.
/// Arguments are checked before anything is sent and bad ones throw Error(kInvalidArgument)
/// at the call; failures while running (timeout, a peer exiting, ranks that disagree about
/// the operation) surface from Request::wait. Buffers must stay valid until the request
/// completes; the argument arrays (spans) are copied at the call.
///
/// Collectives use shared memory between processes of one host. All ranks get bit-identical
/// results: every element is reduced in rank order 0..size-1 exactly once.
class Communicator {
 public:
  /// Joins a communicator of `size` ranks as `rank`, meeting the others through `store`.
  /// Blocks until all ranks have joined or `options.timeout` passes. Each rank counts the
  /// communicators it creates through one store, and its n-th meets the others' n-th: ranks
  /// that create communicators independently of each other (two jobs, or two groups of one
  /// job, on one store) give each its own store, such as a PrefixStore per group, as torch
  /// does for its process groups. A round whose ranks make communicators of different
  /// names or sizes (threads that create at once through one store) is refused on every
  /// rank, naming both, rather than joined.
  static std::shared_ptr<Communicator> create(int rank, int size, std::shared_ptr<Store> store,
                                              const CommOptions& options = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const;
  int size() const;
  const std::string& name() const;
  /// Sequence number of the last collective issued (0 before the first).
  uint64_t lastSequence() const;
  /// Changes the default deadline for operations issued from now on.
  void setTimeout(std::chrono::milliseconds timeout);

  /// Making a child (split, subset, shrink): errors name the child's ranks, and where
  /// `options.rankLegend` is empty they end saying which rank of this communicator each is
  /// (the child's failure report too).
  ///
  /// Collective over this communicator: ranks passing the same `color` form a new
  /// communicator, ordered by (`key`, old rank). A negative color returns nullptr.
  std::shared_ptr<Communicator> split(int color, int key, const CommOptions& options = {});
  /// Collective over the listed ranks only (others do not call): a communicator of
  /// `ranks` (ranks of this communicator, in any order), new rank = position in the list.
  /// Every member must pass the same list in the same order, and the same `tag` (which
  /// tells apart several subsets of the same ranks): members that differ do not meet, and
  /// fail at the timeout.
  std::shared_ptr<Communicator> subset(std::span<const int> ranks, const std::string& tag,
                                       const CommOptions& options = {});
  /// subset() of a braced list: `comm->subset({0, 2}, "pair")`.
  std::shared_ptr<Communicator> subset(std::initializer_list<int> ranks, const std::string& tag,
                                       const CommOptions& options = {}) {
    return subset(std::span<const int>(ranks.begin(), ranks.size()), tag, options);
  }

  /// Rebuilds without the `excluded` ranks (typically ones that died): every other rank
  /// calls it, and gets a communicator of the remaining ranks in their old order. Works on
  /// a communicator that has failed; the old one stays failed (destroy it). `abortFirst`
  /// (torch's SHRINK_ABORT): aborts this communicator, failing what is pending, once the
  /// arguments are checked; a call refused for its arguments leaves it as it was.
  std::shared_ptr<Communicator> shrink(std::span<const int> excluded,
                                       const CommOptions& options = {}, bool abortFirst = false);
  /// shrink() of a braced list: `comm->shrink({dead})`.
  std::shared_ptr<Communicator> shrink(std::initializer_list<int> excluded,
                                       const CommOptions& options = {}, bool abortFirst = false) {
    return shrink(std::span<const int>(excluded.begin(), excluded.size()), options, abortFirst);
  }

  /// Throws what a call named `op` would throw now if this communicator has failed, was shut
  /// down or belongs to the process this one was forked from; otherwise does nothing.
  void requireUsable(std::string_view op) const;
  /// Throws what subset() of `members` would throw before it meets them: requireUsable's
  /// error, except that a failed communicator still makes a subset of ranks its failure
  /// spares, none of which died, left or aborted it (torch's new_group after a timeout or
  /// over the survivors of a death, as Gloo's does over the store).
  void requireMembersUsable(std::span<const int> members, std::string_view op) const;

  /// What every rank last started and finished, read from shared memory: one line per rank
  /// (pid, alive/left/DEAD, last collective started, last finished). For diagnosing hangs.
  std::string progressReport() const;

  /// Reduces `count` elements across ranks into every rank's `output`. In place if
  /// input == output.
  Request allReduce(const void* input, void* output, size_t count, DataType type, ReduceOp op,
                    const OpOptions& options = {});
  /// Reduces into `output` of `root` only (output ignored elsewhere, may be null).
  Request reduce(const void* input, void* output, size_t count, DataType type, ReduceOp op,
                 int root, const OpOptions& options = {});
  /// Copies root's `input` into every rank's `output` (root may pass input == output;
  /// other ranks' input is ignored).
  Request broadcast(const void* input, void* output, size_t count, DataType type, int root,
                    const OpOptions& options = {});
  /// Every rank contributes `count` elements; `output` receives size*count, rank order.
  /// In place if input == output + rank*count.
  Request allGather(const void* input, void* output, size_t count, DataType type,
                    const OpOptions& options = {});
  /// Rank q contributes counts[q] elements (counts[rank] from `input`) into outputs[q].
  Request allGatherV(const void* input, std::span<void* const> outputs,
                     std::span<const size_t> counts, DataType type, const OpOptions& options = {});
  /// Where an allGatherVPlaced puts each rank's elements: outputs[q] receives counts[q] from q.
  struct Placement {
    std::vector<void*> outputs;
    std::vector<size_t> counts;
  };
  /// An allGatherV whose counts (and so outputs) are known only once the calls issued before
  /// it on this communicator have run, such as a gather of every rank's count: `place`,
  /// called as this call starts, on the thread that runs it, says them. Queued at once in
  /// issue order like any call, so the caller need not wait for the earlier call (an
  /// asynchronous caller would block, and ranks that order their calls on two communicators
  /// differently would wait for each other). Every rank's `place` must return the same
  /// counts; `input` holds this rank's counts[rank] elements. A `place` that throws, or
  /// returns what allGatherV would refuse, fails the communicator (the peers are already in
  /// the call). Host memory only.
  Request allGatherVPlaced(const void* input, std::function<Placement()> place, DataType type,
                           const OpOptions& options = {});
  /// `input` holds size blocks of `count`; rank q gets the reduction of block q.
  Request reduceScatter(const void* input, void* output, size_t count, DataType type, ReduceOp op,
                        const OpOptions& options = {});
  /// Block q (inputs[q], counts[q] elements) is reduced across ranks into rank q's output.
  Request reduceScatterV(std::span<const void* const> inputs, void* output,
                         std::span<const size_t> counts, DataType type, ReduceOp op,
                         const OpOptions& options = {});
  /// Block q of `input` (count elements) goes to rank q; block q of `output` comes from q.
  Request allToAll(const void* input, void* output, size_t count, DataType type,
                   const OpOptions& options = {});
  /// inputs[q] (sendCounts[q] elements) goes to rank q; outputs[q] (recvCounts[q]) comes
  /// from q. Rank q's sendCounts[r] must equal rank r's recvCounts[q].
  Request allToAllV(std::span<const void* const> inputs, std::span<const size_t> sendCounts,
                    std::span<void* const> outputs, std::span<const size_t> recvCounts,
                    DataType type, const OpOptions& options = {});
  /// Root receives every rank's `count` elements into outputs[q] (ignored elsewhere).
  Request gather(const void* input, std::span<void* const> outputs, size_t count, DataType type,
                 int root, const OpOptions& options = {});
  /// Rank q receives root's inputs[q] (`count` elements) into `output`.
  Request scatter(std::span<const void* const> inputs, void* output, size_t count, DataType type,
                  int root, const OpOptions& options = {});
  /// Completes on each rank once every rank has entered it.
  Request barrier(const OpOptions& options = {});

  /// Sends `count` elements to `peer` with `tag`. Completes once the data is copied out of
  /// `data` (which can then be reused); independent of the collective queue.
  Request send(const void* data, size_t count, DataType type, int peer, int tag,
               const OpOptions& options = {});
  /// Receives a message of at most `count` elements from `peer` (or kAnySource) with `tag`
  /// into the front of `data` (the rest keeps its values, as with Gloo and MPI); a larger
  /// message fails this receive, naming both sizes. Messages from one sender with one tag
  /// arrive in the order they were sent.
  /// On CUDA memory (OpOptions::device), like NCCL: a pair's messages match in the order
  /// issued and must agree in tag and size (a disagreement fails with kMismatch), a send
  /// may wait until its receive is issued, and kAnySource is refused.
  Request recv(void* data, size_t count, DataType type, int peer, int tag,
               const OpOptions& options = {});
  /// Opens a group: device sends and receives issued until the matching endGroup are
  /// queued together at endGroup and progress together, so ones that depend on each other
  /// (a ring exchange, a halo swap) cannot deadlock. Host-memory ones are unaffected (they
  /// always progress independently). Groups nest; like ncclGroupStart.
  void startGroup();
  /// Closes a group, queueing its device transfers on their stream. If they are refused,
  /// their requests fail with the reason, which is also thrown here.
  void endGroup();
  /// Sets up this communicator's operations on `device` memory now, with every rank of it
  /// (a collective), instead of at the first such operation: then a first send/recv
  /// between two ranks does not wait for the others. A no-op for kCpu.
  void connectDevice(DeviceKind device, int deviceIndex);

  /// Fails every pending and future operation of this communicator and of its peers'
  /// copies at once (Error kAborted); never blocks. Safe from any thread. A no-op once
  /// shutdown() has ended (this rank has left; its peers go on).
  void abort();
  /// Waits for the collectives and sends already issued (a send until it is delivered or
  /// reaches its deadline, 10 s at most), fails the receives still pending (Error kAborted),
  /// then releases the communicator's resources; later operations throw Error(kAborted).
  /// Refused (Error kInvalidArgument) in a completion callback on its own threads.
  void shutdown();

  /// Internal: the state behind this handle.
  explicit Communicator(std::shared_ptr<detail::CommState> state);

 private:
  std::shared_ptr<detail::CommState> state_;
};

}  // namespace loom
