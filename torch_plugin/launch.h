#pragma once

// The one path every ProcessGroupLoom operation takes from checked arguments to a Work.

#include <c10/core/Stream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "call_timing.h"
#include "exit_shutdown.h"
#include "finished_work.h"
#include "loom/error.h"
#include "process_group_loom.h"
#include "util/trace.h"

namespace loom::torch_plugin {

/// Runs `f` without the GIL if this thread holds it (a no-op outside Python): what blocks
/// here (a blocking collective, tearing a communicator down) must not stall other Python
/// threads or the completion callbacks that need the GIL.
template <class F>
void releasingGil(F&& f) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    pybind11::gil_scoped_release unlocked;
    f();
  } else {
    f();
  }
}

/// Rethrows a loom error as the torch error Python users expect: bad arguments are the
/// caller's to fix (RuntimeError, like Gloo's checks); anything else (a failed, timed-out or
/// shut-down communicator) is a DistBackendError.
/// `legend` follows the message (GroupTies), after exitNote() for the group of `ties`.
[[noreturn]] inline void rethrowForTorch(const Error& e, const std::string& legend = {},
                                         const GroupTies* ties = nullptr) {
  if (e.code() == ErrorCode::kInvalidArgument) TORCH_CHECK(false, e.what() + legend);
  C10_THROW_ERROR(DistBackendError, e.what() + exitNote(e, ties) + legend);
}

/// Desync debug: the signature of the call being launched on this thread; opOptions() puts
/// it into every loom operation the call issues.
inline thread_local std::string tLaunchSignature;

/// A CUDA call being launched on this thread: opOptions() queues its loom operations on
/// the group's loom stream for that device. Unset for CPU calls.
inline thread_local std::optional<c10::Stream> tLaunchStream;

/// Whether every one of `requests` has ended.
inline bool allEnded(c10::ArrayRef<Request> requests) {
  for (const Request& r : requests) {
    if (!r.test()) return false;
  }
  return true;
}

template <class OutputList, class Issue>
c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::launch(const CallSite& site, c10d::OpType type,
                                                        const char* title,
                                                        const std::vector<at::Tensor>& inputs,
                                                        OutputList&& outputs,
                                                        std::function<void()> finisher,
                                                        Issue&& issue, size_t futureLists) {
  // LOOM_TRACE: the whole c10d call as this backend sees it, around the engine's collective
  // span(s), so a timeline shows what the call costs outside the engine.
  const trace::Span span("c10d call", static_cast<uint64_t>(type));
  Requests requests;
  // What the call's stream reads and writes besides the outputs: the caller's inputs, and
  // the copies staged for this call (CPU calls have none, and make no list). Taken first, so
  // that a refusal below leaves none behind for the thread's next call.
  std::vector<at::Tensor> staged = takeStaged();
  if (!staged.empty()) staged.insert(staged.begin(), inputs.begin(), inputs.end());
  const std::vector<at::Tensor>& uses = staged.empty() ? inputs : staged;
  // CUDA tensors: the collectives go on the loom stream, after the work the caller has
  // queued so far on its current stream.
  const std::optional<c10::Stream> stream = cudaStreamFor(site, inputs, outputs);
  const bool pointToPoint = type == c10d::OpType::SEND || type == c10d::OpType::RECV ||
                            type == c10d::OpType::RECVANYSOURCE;
  // Work.getDuration(): a CUDA call is timed by events around what it queues (CallTiming).
  // In a coalescing block, the first CUDA collective starts the block's timing too; CUDA
  // sends and receives there are held until the block ends (below), which starts the
  // block's timing if no collective did (endCoalescing), and have no time of their own.
  const bool timed = ties_->timing.load(std::memory_order_relaxed);
  std::optional<CallTiming> gpuTiming;
  if (timed && stream) {
    const bool inBlockNow = coalescing_.load(std::memory_order_acquire);
    if (!(inBlockNow && pointToPoint)) gpuTiming.emplace(CallTiming::onStream(*stream));
    if (inBlockNow && !pointToPoint) {
      std::lock_guard<std::mutex> lock(coalesceMutex_);
      if (coalescing_ && !blockTiming_) blockTiming_.emplace(CallTiming::onStream(*stream));
    }
  }
  {
    // What opOptions() reads for this call, cleared however issue() ends.
    struct CallScope {
      ~CallScope() {
        tLaunchSignature.clear();
        tLaunchStream.reset();
      }
    } scope;
    if (desyncDebug_) tLaunchSignature = signatureOf(type, inputs, outputs);
    tLaunchStream = stream;
    try {
      // Blocking calls (async_op=False) run the collective right here: no GIL meanwhile.
      releasingGil([&] { issue(requests); });
    } catch (...) {
      // A call of several operations refused at its second or later: those issued before
      // still run, on staged copies the finisher owns and on the caller's tensors.
      abandonIssued(stream, uses, outputs, std::move(finisher), requests);
      // The loom stream was made to follow the caller's: join it back.
      rejoinRefused(stream);
      try {
        throw;
      } catch (const Error& e) {
        rethrowForTorch(e, ties_->legend, ties_.get());
      }
    }
  }
  if (stream) acceptedOn(*stream);
  // A CUDA send or receive inside a coalescing block is held by loom until the block ends
  // (endCoalescing): so are its copy-backs, and its own work waits on the host (the
  // block's work has the stream semantics; batch_isend_irecv returns that one).
  bool held = false;
  std::shared_ptr<HeldEnd> heldEnd;  // a held call's end, marked once the block queues it
  bool inBlock = false;
  // Outside a block (nearly every call) no lock: the flag changes only in start/
  // endCoalescing, which a caller orders with its own calls.
  if (coalescing_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(coalesceMutex_);
    if (coalescing_) {
      inBlock = true;
      forgetEndedInBlock();
      coalesced_.insert(coalesced_.end(), requests.begin(), requests.end());
      if (stream) coalescedStream_ = stream;
      held = stream && pointToPoint;
      if (held) {
        heldEnd = std::make_shared<HeldEnd>();
        held_.push_back({*stream, uses, outputs, finisher, requests, heldEnd});
      }
    }
  }
  if (stream) {
    if (!held) finishOnStream(*stream, uses, outputs, finisher, requests);
    finisher = nullptr;
    if (gpuTiming) gpuTiming->queued(*stream);
  }
  // A CPU call over by now (a blocking one ran right here): a work with nothing to track.
  if (!stream && allEnded(requests)) {
    auto work = c10::make_intrusive<FinishedWork>(rank_, type, title, inputs, outputs, finisher,
                                                  requests, *ties_, timed);
    work->setFutureLists(futureLists);
    return work;
  }
  // A held call's work waits on the host: no stream semantics, so no end event either.
  const std::optional<c10::Stream> workStream = held ? std::nullopt : stream;
  const bool copiesBack = static_cast<bool>(finisher);
  auto work = c10::make_intrusive<WorkLoom>(
      rank_, type, title, site.op, inputs,
      std::vector<at::Tensor>(std::forward<OutputList>(outputs)), std::move(finisher), workStream,
      workStream ? events_ : nullptr);
  work->setFutureLists(futureLists);
  work->tieTo(ties_);
  if (gpuTiming && !held) {
    work->timeWith(std::move(*gpuTiming));
  } else if (timed && !stream) {
    work->timeWith(CallTiming(requests));
  }
  if (held) work->markHeld(heldEnd);  // its getDuration() points to the block's work
  work->track(requests, inputs);
  if (!stream && site.writes) noteAsync(work, type);
  if (inBlock && copiesBack) {
    // Its requests end before its finisher has copied the results back (their callbacks
    // run after they are marked done): the block's work must wait for this work itself.
    std::lock_guard<std::mutex> lock(coalesceMutex_);
    copyingBack_.push_back(work);
  }
  return work;
}

template <class F>
c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::heldInBlock(c10d::OpType type, F&& f) {
  if (!coalescing_.load(std::memory_order_acquire)) return f();
  try {
    return f();
  } catch (...) {
    const std::exception_ptr error = std::current_exception();
    {
      std::lock_guard<std::mutex> lock(coalesceMutex_);
      if (!coalescing_) throw;  // the block ended meanwhile: not its error
      if (!blockError_) blockError_ = error;
    }
    // The work of the refused operation fails with its error (its finisher raises it).
    return c10::make_intrusive<FinishedWork>(
        rank_, type, "loom:refused", std::vector<at::Tensor>{}, c10::ArrayRef<at::Tensor>{},
        [error] { std::rethrow_exception(error); }, c10::ArrayRef<Request>{}, *ties_);
  }
}

}  // namespace loom::torch_plugin
