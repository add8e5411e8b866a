#pragma once

// c10d::Work over one or more loom requests. It completes when the last request does: the
// finisher runs (copying staged outputs back), the future is fulfilled with the output
// tensors (or set to the error), and waiters wake. This happens on the thread that finished
// the last request (the communicator's worker), so DDP comm hooks and functional collectives
// chained on get_future() run there, as they do on Gloo's worker threads.
//
// A CPU call whose requests had all ended when it returned (a blocking collective runs on
// the caller's thread) gets a FinishedWork instead (finished_work.h).
//
// CUDA work (made with the loom stream its collectives were queued on) follows NCCL's
// semantics instead: wait() makes the caller's current stream wait for the collectives (no
// host blocking; synchronize() blocks the host as well), isCompleted() asks the GPU, and the
// future, made when first asked for (DDP asks, most callers never do), is complete from the
// start and bound to a stream that waits for the collectives, so callbacks chained on it are
// ordered after them by torch's CUDA-aware futures. A failure found later (a dead peer, a
// timeout) is raised by wait() and fails the communicator. The event that marks a CUDA
// work's end comes from its group's EventPool and goes back there with the work.

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "call_timing.h"
#include "event_pool.h"
#include "loom/request.h"

namespace loom::torch_plugin {

/// What loom's exit handler did to a group: nothing yet, shut it down, or aborted its calls.
enum class ExitMark { kNone, kShutDown, kAborted };

/// What a group's works share with it.
struct GroupTies {
  /// Works whose wait(timeout) expired and that have not finished since: their caller gave
  /// up on them, so the group's shutdown aborts them rather than wait out their timeout.
  std::atomic<int> givenUp{0};
  /// The group times its calls for Work.getDuration() (ProcessGroup._enable_collectives_
  /// timing): calls made from then on are timed (CallTiming).
  std::atomic<bool> timing{false};
  /// Where the group's ranks are not the global ranks (a new_group, a DeviceMesh dimension),
  /// what its error messages end with: which global rank each of its ranks is (legendOf()).
  std::string legend;
  /// What loom's exit handler did to the group (exit_shutdown.h), for the note its errors
  /// end with from then on.
  std::atomic<ExitMark> atExit{ExitMark::kNone};
};

/// What the ranks of group `name` are when they are the global ranks `global`: "ranks of
/// process group 'tp'; its ranks 0 to 1 are global ranks 4, 5" (CommOptions::rankLegend).
/// Empty for the world, or a group numbered as the world is.
std::string ranksOf(const std::string& name, const std::string& desc,
                    const std::vector<uint64_t>& global);

/// The legend the group's messages end with (GroupTies::legend), from ranksOf's sentence.
std::string legendOf(const std::string& ranks);

/// Work.source_rank() of a call of `type` named `what` on `rank`: `source` for a receive;
/// for any other call the error torch's own works raise (Gloo's too).
int sourceOfReceive(c10d::OpType type, int source, const std::string& what, int rank);

/// Where a CUDA send or receive held by a coalescing block ends: recorded on its stream once
/// the block has queued it and its copy-back (endCoalescing), so that its own work's wait()
/// orders the caller's stream after that copy-back, not only after the transfer.
class HeldEnd {
 public:
  /// The mark: an event recorded on the call's stream after its copy-back (one per block
  /// and stream, shared by the block's held calls there).
  void set(std::shared_ptr<const c10::Event> event);
  /// The caller's current stream waits for the mark (nothing before it is recorded).
  void blockCurrentStream();
  /// The host waits for the mark.
  void synchronize();

 private:
  std::mutex mutex_;
  std::shared_ptr<const c10::Event> event_;
};

class WorkLoom : public c10d::Work {
 public:
  /// `what` names the operation for messages ("all_reduce"); `inputs` give the profiler
  /// event its shapes; `outputs` are the tensors result() and the future return; `finisher`
  /// runs once every request has succeeded.
  /// `cudaStream`: the loom stream of a CUDA call (its collectives and copy-backs are
  /// queued there already), and `events` the pool its end event comes from (required with
  /// a stream); nullopt and null for CPU work.
  WorkLoom(int rank, c10d::OpType type, const char* profilingTitle, std::string what,
           const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs,
           std::function<void()> finisher, std::optional<c10::Stream> cudaStream = std::nullopt,
           std::shared_ptr<EventPool> events = nullptr);
  ~WorkLoom() override;
  /// The last strong reference is gone while a weak one remains (the group's record of calls
  /// still writing, noteAsync): the tensors, the finisher and the future go now.
  void release_resources() override;

  /// Starts waiting on `requests` (call exactly once, before the work is shared). If they
  /// have all ended (an empty list included), the work completes here, on this thread.
  /// Otherwise CPU work holds `reads`, the caller's tensors its collectives read, until it
  /// completes (the caller may drop them, and the work, before then).
  void track(c10::ArrayRef<Request> requests, const std::vector<at::Tensor>& reads = {});
  /// Makes the future hold the outputs as `lists` equal lists (0, the default: one list);
  /// call before track().
  void setFutureLists(size_t lists) { futureLists_ = lists; }
  /// Ties this work to its group (GroupTies): its errors end with the group's legend, and it
  /// counts in the group's givenUp while a wait(timeout) on it has expired and it has not
  /// finished; call before track().
  void tieTo(std::shared_ptr<GroupTies> ties) { ties_ = std::move(ties); }
  /// Runs `settle` (which must not throw) before the work completes, failed or not: a
  /// coalescing block's wait for its calls' copy-backs, which must be over before its caller
  /// learns of a failure and reuses their tensors; call before track().
  void settleFirst(std::function<void()> settle) { settle_ = std::move(settle); }
  /// Times the call for getDuration() (its group times its calls: CallTiming); call
  /// before track().
  void timeWith(CallTiming timing) { timing_ = std::make_unique<CallTiming>(std::move(timing)); }
  /// A CUDA call's work that waits on the host (a send or receive held by a coalescing
  /// block, which ends at `end`): wait() also orders the caller's stream after `end`,
  /// synchronize() waits for it, and getDuration() refuses, naming the block's work; call
  /// before track().
  void markHeld(std::shared_ptr<HeldEnd> end) {
    held_ = true;
    heldEnd_ = std::move(end);
  }

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  /// Waits (spinning briefly first); a timeout throws DistBackendError naming the operation.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  /// Ends its sends and receives that have not begun (Request::cancel; Gloo's SendWork and
  /// RecvWork abort too): wait() then returns false, as torch's Work::wait says of an
  /// aborted work. A send or receive under way, and a collective, run on (abort the group
  /// to end those); a CUDA call is under way once it is queued, so this ends none.
  void abort() override;
  /// CPU work: nothing (wait() is the way to wait). CUDA work: the current stream waits for
  /// the collectives, and the host blocks until the GPU has run them.
  void synchronize() override;
  /// CUDA work: the caller's current stream waits for the collectives. CPU work: torch's
  /// way (the current CUDA stream spins until the future completes).
  void blockCurrentStream() override;
  /// The future of the outputs; for CUDA work, made on the first call. Asked on a loom thread
  /// before the call ended (a callback chained on another call), it runs the call first.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override { return seq_; }
  /// The call's active time in milliseconds (CallTiming), once it has ended (a CUDA call:
  /// once the GPU has run it); an error if its group was not timing its calls when it was
  /// made, or for a CUDA send or receive held by a coalescing block.
  float getDuration() const override;

 private:
  WorkLoom(int rank, c10d::OpType type, const char* profilingTitle, std::string what,
           const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs,
           std::function<void()> finisher, std::optional<c10::Stream> cudaStream,
           std::shared_ptr<EventPool> events, bool profiling);
  void requestDone(std::exception_ptr error, int source);
  /// wait() of a work without a CUDA stream: on the host, until its requests have ended.
  bool waitWithoutStream(std::chrono::milliseconds timeout);
  /// Completes the work on this thread if every request has ended though their callbacks
  /// have not all run: they run one operation after another on the thread that ended them,
  /// and a callback of an earlier one may be what waits for this work (wait()).
  void completeIfEnded();
  /// CUDA work waited on with a timeout (as NCCL's): the host waits until the call's outcome
  /// is known, it failed, or the timeout passes (timedOut).
  void waitOnHost(std::chrono::milliseconds timeout);
  /// Counts the work as given up on and throws DistBackendError; with mutex_ held.
  [[noreturn]] void timedOut(std::chrono::milliseconds timeout);
  /// Runs the finisher (unless `failure`), fulfils the future if there is one, and finishes.
  void complete(std::exception_ptr failure);
  /// Publishes the ended work: done_, the future (completed with the outputs, or failed
  /// with `failure`), then finish() for waiters.
  void publish(const std::exception_ptr& failure);
  /// CUDA work: the first failure so far, as DistBackendError (nullptr if none).
  std::exception_ptr failureSoFar();

  std::string what_;
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> reads_;  // CPU work, until complete()
  std::function<void()> finisher_;
  std::function<void()> settle_;  // settleFirst()
  // CUDA work: null until getFuture() makes it (once, under futureOnce_); CPU work: set in
  // track(), before the work is shared.
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::once_flag futureOnce_;
  std::atomic<int> pending_{0};
  std::atomic<bool> completing_{false};  // complete() claimed (requestDone or completeIfEnded)
  bool requestsKnown_ = false;           // awaited_ and earlier_ are every request
  std::atomic<bool> ended_{false};       // results in place and outcome_ set (maybe not published)
  std::atomic<bool> done_{false};        // published: set before the future is marked
  std::exception_ptr outcome_;           // written once, before done_ is set
  size_t futureLists_ = 0;
  std::atomic<int> source_{-1};
  uint64_t seq_ = 0;
  std::mutex errorMutex_;
  std::exception_ptr firstError_;          // guarded by errorMutex_
  std::optional<c10::Stream> cudaStream_;  // CUDA work: the loom stream
  std::optional<c10::Event> cudaEnd_;      // CUDA work: recorded after everything it queued
  std::shared_ptr<EventPool> events_;      // CUDA work: where cudaEnd_ goes back to
  std::shared_ptr<GroupTies> ties_;        // see tieTo()
  std::unique_ptr<CallTiming> timing_;     // see timeWith(); null: not timed
  bool held_ = false;                      // see markHeld()
  std::shared_ptr<HeldEnd> heldEnd_;       // see markHeld()
  Request awaited_;  // its last request, which a wait on a worker thread may run (wait())
  std::vector<Request> earlier_;      // the others, of a block: driven too on the send/recv thread
  bool countedAsGivenUp_ = false;     // guarded by mutex_ (c10d::Work's)
  std::atomic<bool> aborted_{false};  // abort() was called: a failure reads as aborted
};

/// loom::Error as the exception torch users expect: DistBackendError (a RuntimeError), its
/// message followed by the legend of its group's `ties` (and exitNote()).
std::exception_ptr asDistBackendError(std::exception_ptr error, const GroupTies* ties = nullptr);

/// A call's outcome once its requests have ended with `failure` (null: all succeeded): runs
/// `finisher` (copy-backs) unless the call failed, and returns the failure, the finisher's
/// included, as DistBackendError (null on success).
std::exception_ptr finishCall(std::exception_ptr failure, const std::function<void()>& finisher,
                              const GroupTies* ties = nullptr);

/// What a work's future holds: `outputs` as one list, or (`lists` > 0) as that many lists of
/// equal length, in order (Gloo's all_gather_coalesced future: one list per rank).
c10::TypePtr futureTypeOf(size_t lists);
c10::IValue futureValueOf(c10::ArrayRef<at::Tensor> outputs, size_t lists);

/// Whether a profiler listens (a work then records the call as an event with its inputs).
bool profilerListens();

/// What the profiler records as a call's inputs; nullopt unless `profiling`.
std::optional<std::vector<at::Tensor>> profiledInputs(bool profiling,
                                                      const std::vector<at::Tensor>& inputs);

/// The loom requests of one c10d call: most calls issue one, kept inline.
using Requests = c10::SmallVector<Request, 1>;

}  // namespace loom::torch_plugin
