// Completing c10d works from loom requests.

#include "work_loom.h"

#include <ATen/core/jit_type.h>
#include <ATen/record_function.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <sched.h>

#include <algorithm>
#include <thread>

#include "core/op_state.h"
#include "exit_shutdown.h"
#include "launch.h"
#include "loom/error.h"
#include "util/trace.h"
#include "util/worker.h"

namespace loom::torch_plugin {

std::string ranksOf(const std::string& name, const std::string& desc,
                    const std::vector<uint64_t>& global) {
  bool world = true;
  for (size_t i = 0; i < global.size(); ++i) world = world && global[i] == i;
  if (world) return {};
  constexpr size_t kListed = 64;
  std::string s = "ranks of process group '" + name + "'";
  if (!desc.empty() && desc != "undefined") s += " (" + desc + ")";
  s += "; its ranks 0 to " + std::to_string(global.size() - 1) + " are global ranks ";
  for (size_t i = 0; i < global.size() && i < kListed; ++i) {
    s += (i > 0 ? ", " : "") + std::to_string(global[i]);
  }
  if (global.size() > kListed) s += ", ... (" + std::to_string(global.size()) + " in all)";
  return s;
}

int sourceOfReceive(c10d::OpType type, int source, const std::string& what, int rank) {
  if (type != c10d::OpType::RECV && type != c10d::OpType::RECVANYSOURCE) {
    TORCH_CHECK(false, "loom: Work.source_rank() of " + what + " on rank " + std::to_string(rank) +
                           ": only the work of a receive (recv or irecv) has a source rank");
  }
  return source;
}

std::string legendOf(const std::string& ranks) {
  return ranks.empty() ? std::string() : " (ranks in this message are " + ranks + ")";
}

std::exception_ptr asDistBackendError(std::exception_ptr error, const GroupTies* ties) {
  if (!error) return nullptr;
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error&) {
    return error;  // already a torch error (DistBackendError or a check)
  } catch (const std::exception& e) {
    try {
      C10_THROW_ERROR(DistBackendError,
                      e.what() + exitNote(e, ties) + (ties ? ties->legend : std::string()));
    } catch (...) {
      return std::current_exception();
    }
  }
  return error;
}

std::exception_ptr finishCall(std::exception_ptr failure, const std::function<void()>& finisher,
                              const GroupTies* ties) {
  if (!failure && finisher) {
    try {
      finisher();
    } catch (...) {
      failure = std::current_exception();
    }
  }
  return asDistBackendError(failure, ties);
}

namespace {

// Whether a wait's `timeout` sets a limit: kNoTimeout and a timeout of centuries do not (now()
// plus one would overflow the clock's count).
bool bounded(std::chrono::milliseconds timeout) {
  return timeout != kNoTimeout && timeout <= std::chrono::hours(24 * 365 * 100);
}

}  // namespace

c10::TypePtr futureTypeOf(size_t lists) {
  return lists == 0 ? c10::ListType::ofTensors()
                    : c10::ListType::create(c10::ListType::ofTensors());
}

c10::IValue futureValueOf(c10::ArrayRef<at::Tensor> outputs, size_t lists) {
  if (lists == 0) return c10::IValue(outputs.vec());
  const size_t each = outputs.size() / lists;
  std::vector<std::vector<at::Tensor>> nested;
  nested.reserve(lists);
  for (size_t i = 0; i < lists; ++i) nested.push_back(outputs.slice(i * each, each).vec());
  return c10::IValue(nested);
}

bool profilerListens() {
  // Asked as the RecordFunction that c10d::Work makes for a title would ask (user scope,
  // the dispatcher's fast path): at::hasCallbacks() takes a lock, a few hundred
  // instructions on every call.
  return at::getStepCallbacksUnlessEmpty(at::RecordScope::USER_SCOPE).has_value();
}

std::optional<std::vector<at::Tensor>> profiledInputs(bool profiling,
                                                      const std::vector<at::Tensor>& inputs) {
  // Complex tensors as their real views, which is what travels (and what Gloo reports).
  // Nothing while no profiler listens: torch's Work would build a RecordFunction only to
  // find it inactive, a cost on every small call.
  if (!profiling) return std::nullopt;
  std::vector<at::Tensor> shown;
  for (const auto& t : inputs)
    shown.push_back(t.is_complex() ? at::view_as_real(t.resolve_conj()) : t);
  return shown;
}

WorkLoom::WorkLoom(int rank, c10d::OpType type, const char* profilingTitle, std::string what,
                   const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs,
                   std::function<void()> finisher, std::optional<c10::Stream> cudaStream,
                   std::shared_ptr<EventPool> events)
    : WorkLoom(rank, type, profilingTitle, std::move(what), inputs, std::move(outputs),
               std::move(finisher), cudaStream, std::move(events), profilerListens()) {}

WorkLoom::WorkLoom(int rank, c10d::OpType type, const char* profilingTitle, std::string what,
                   const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> outputs,
                   std::function<void()> finisher, std::optional<c10::Stream> cudaStream,
                   std::shared_ptr<EventPool> events, bool profiling)
    : c10d::Work(rank, type, profiling ? profilingTitle : nullptr,
                 profiledInputs(profiling, inputs)),
      what_(std::move(what)),
      outputs_(std::move(outputs)),
      finisher_(std::move(finisher)),
      cudaStream_(cudaStream),
      events_(std::move(events)) {
  if (!cudaStream_) return;  // the future comes in track(), if the work is not done by then
  // Everything this work queued is on the loom stream: mark its end there.
  const c10::Device device = cudaStream_->device();
  cudaEnd_.emplace(events_->take(device));
  cudaEnd_->record(*cudaStream_);
}

WorkLoom::~WorkLoom() {
  if (cudaEnd_) events_->give(std::move(*cudaEnd_));
}

void WorkLoom::release_resources() {
  outputs_ = {};
  reads_ = {};
  finisher_ = nullptr;
  future_.reset();
}

void WorkLoom::track(c10::ArrayRef<Request> requests, const std::vector<at::Tensor>& reads) {
  if (!requests.empty()) seq_ = requests.back().sequence();
  if (!cudaStream_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(futureTypeOf(futureLists_));
    reads_ = reads;
  }
  if (requests.empty()) {
    complete(nullptr);
    return;
  }
  pending_.store(static_cast<int>(requests.size()), std::memory_order_release);
  // Issued last: on a collective worker the others end before it. A block's sends and
  // receives end in any order (each as its peer's message comes): a wait on the send/recv
  // thread drives them all (other works of several requests are collectives).
  awaited_ = requests.back();
  if (requests.size() > 1 && retrieveOpType() == c10d::OpType::COALESCED) {
    earlier_.assign(requests.begin(), requests.end() - 1);
  }
  requestsKnown_ = requests.size() == earlier_.size() + 1;
  // Each callback holds a reference, so the work outlives its requests even if the caller
  // drops it. A request already finished (a blocking call ran on this thread) is counted
  // here: no callback to allocate and run.
  for (const Request& r : requests) {
    if (r.test()) {
      requestDone(r.error(), r.sourceRank());
      continue;
    }
    c10::intrusive_ptr<WorkLoom> self = c10::intrusive_ptr<WorkLoom>::reclaim_copy(this);
    r.onComplete(
        [self, r](std::exception_ptr e) { self->requestDone(std::move(e), r.sourceRank()); });
  }
}

void WorkLoom::requestDone(std::exception_ptr error, int source) {
  if (source >= 0) source_.store(source, std::memory_order_relaxed);
  if (error) {
    std::lock_guard<std::mutex> lock(errorMutex_);
    if (!firstError_) firstError_ = error;
  }
  if (pending_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (completing_.exchange(true, std::memory_order_acq_rel)) return;  // completeIfEnded did
  std::exception_ptr failure;
  {
    std::lock_guard<std::mutex> lock(errorMutex_);
    failure = firstError_;
  }
  complete(failure);
}

void WorkLoom::completeIfEnded() {
  if (!requestsKnown_ || completing_.load(std::memory_order_acquire) || !awaited_.test()) return;
  for (const Request& r : earlier_) {
    if (!r.test()) return;
  }
  if (completing_.exchange(true, std::memory_order_acq_rel)) return;
  std::exception_ptr failure;
  const auto take = [&](const Request& r) {
    if (r.sourceRank() >= 0) source_.store(r.sourceRank(), std::memory_order_relaxed);
    if (!failure) failure = r.error();
  };
  for (const Request& r : earlier_) take(r);
  take(awaited_);
  complete(failure);
}

void WorkLoom::complete(std::exception_ptr failure) {
  if (settle_) {
    settle_();
    settle_ = nullptr;
  }
  failure = finishCall(failure, finisher_, ties_.get());
  finisher_ = nullptr;  // releases staged tensors
  if (timing_ && !timing_->onGpu()) timing_->ended();
  reads_.clear();
  outcome_ = failure;
  ended_.store(true, std::memory_order_release);
  // Deep in a collective worker's nesting (util/worker.h) the callbacks chained on the
  // future would nest further: the work is published complete, with its future, once the
  // thread is back up (a callback waiting on it there reads ended_ meanwhile).
  if (Worker* worker = Worker::current();
      !cudaStream_ && future_ && worker != nullptr && worker->deep()) {
    worker->defer([self = c10::intrusive_ptr<WorkLoom>::reclaim_copy(this), failure] {
      self->publish(failure);
    });
    return;
  }
  publish(failure);
}

void WorkLoom::publish(const std::exception_ptr& failure) {
  // Callbacks chained on the future run while it is marked, before finish(): the outcome is
  // published first, so code they wake sees a completed work with its success or error.
  done_.store(true, std::memory_order_release);
  // CUDA work: the future completed at launch.
  if (!cudaStream_ && future_) {
    if (failure) {
      future_->setError(failure);
    } else {
      future_->markCompleted(futureValueOf(outputs_, futureLists_));
    }
  }
  finish(failure);
  std::lock_guard<std::mutex> lock(mutex_);
  if (countedAsGivenUp_) {
    countedAsGivenUp_ = false;
    ties_->givenUp.fetch_sub(1);
  }
}

bool WorkLoom::isCompleted() {
  if (done_.load(std::memory_order_acquire)) return true;
  return cudaStream_ && cudaEnd_->query();
}

std::exception_ptr WorkLoom::failureSoFar() {
  std::lock_guard<std::mutex> lock(errorMutex_);
  return asDistBackendError(firstError_, ties_.get());
}

void WorkLoom::synchronize() {
  if (heldEnd_) {  // a held CUDA send or receive: its requests, then its copy-back
    wait();
    heldEnd_->synchronize();
    return;
  }
  if (!cudaStream_) return;
  blockCurrentStream();
  cudaEnd_->synchronize();  // and the host waits for the GPU too
}

void WorkLoom::blockCurrentStream() {
  if (!cudaStream_) {
    c10d::Work::blockCurrentStream();
    return;
  }
  const c10::impl::VirtualGuardImpl impl(cudaStream_->device_type());
  const c10::Stream current = impl.getStream(cudaStream_->device());
  // A blocking call ran on the current stream itself: its order is already the stream's.
  if (current != *cudaStream_) cudaEnd_->block(current);
}

float WorkLoom::getDuration() const {
  if (held_) refuseHeldTiming(what_, rank_);
  if (!timing_) refuseUntimed(what_, rank_);
  // A host-timed call's time is written before done_ is set (complete()).
  TORCH_CHECK(timing_->onGpu() || done_.load(std::memory_order_acquire),
              durationOf(what_, rank_) + "the call has not ended yet; wait() for it first");
  return timing_->millis(what_, rank_);
}

bool WorkLoom::isSuccess() const {
  return done_.load(std::memory_order_acquire) && !outcome_;
}

std::exception_ptr WorkLoom::exception() const {
  return done_.load(std::memory_order_acquire) ? outcome_ : nullptr;
}

int WorkLoom::sourceRank() const {
  return sourceOfReceive(opType_, source_.load(std::memory_order_relaxed), what_, rank_);
}

std::vector<at::Tensor> WorkLoom::result() {
  return outputs_;
}

void HeldEnd::set(std::shared_ptr<const c10::Event> event) {
  std::lock_guard<std::mutex> lock(mutex_);
  event_ = std::move(event);
}

void HeldEnd::blockCurrentStream() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!event_) return;
  const c10::impl::VirtualGuardImpl impl(event_->device_type());
  event_->block(impl.getStream(event_->device()));
}

void HeldEnd::synchronize() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (event_) event_->synchronize();
}

bool WorkLoom::wait(std::chrono::milliseconds timeout) {
  const trace::Span span("work wait");
  if (cudaStream_) {
    // As NCCL: the caller's stream waits for the collectives and the host goes on; with a
    // timeout, the host waits too, until the GPU is past them or the time is up.
    if (timeout != kNoTimeout) waitOnHost(timeout);
    if (std::exception_ptr failure = failureSoFar()) std::rethrow_exception(failure);
    blockCurrentStream();
    return true;
  }
  const bool ended = waitWithoutStream(timeout);
  // A held CUDA send or receive: its requests end with the transfer, before the copy-back
  // the block queued after it (a staged receive's), which the caller's stream must follow.
  if (ended && heldEnd_) heldEnd_->blockCurrentStream();
  return ended;
}

bool WorkLoom::waitWithoutStream(std::chrono::milliseconds timeout) {
  // After abort(), a call that ended failing (its cancelled send or receive) reads as
  // aborted: false, not an error.
  const auto ended = [&](const std::exception_ptr& failure) {
    if (!failure) return true;
    if (aborted_.load(std::memory_order_acquire)) return false;
    std::rethrow_exception(failure);
  };
  // Over (its results in place, its outcome known): a callback chained on this work's own
  // future may wait on it before finish() below wakes the waiters, on this very thread.
  if (done_.load(std::memory_order_acquire)) return ended(outcome_);
  // A completion callback on a collective worker's thread, or on a send/recv engine's: the
  // request's own wait runs that worker's queue up to the call (util/worker.h), or drives
  // that engine (p2p_engine.h), where waiting for the thread would wait forever; the outcome
  // is the work's, read below.
  // One deadline for the whole wait, however it is spent.
  const auto until =
      std::chrono::steady_clock::now() +
      (bounded(timeout) ? timeout : std::chrono::milliseconds(std::chrono::hours(24 * 365)));
  auto left = [&] {
    return std::max(std::chrono::milliseconds(0),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        until - std::chrono::steady_clock::now()));
  };
  Worker* worker = Worker::current();
  if ((worker != nullptr || detail::waitsMustDrive()) && awaited_.sequence() != 0) {
    // A request's failure is the work's, read below.
    if (detail::waitsMustDrive()) {
      for (const Request& r : earlier_) {
        try {
          r.waitFor(left());
        } catch (...) {
        }
      }
    }
    try {
      awaited_.waitFor(left());
    } catch (...) {
    }
    // Run deep in the worker's nesting, the calls' completions may wait for the thread to
    // come back up, which it does only after this wait: run them here, up to this work's.
    if (worker != nullptr && awaited_.test()) {
      worker->runDeferredHere([this] { return ended_.load(std::memory_order_acquire); });
      if (ended_.load(std::memory_order_acquire)) {  // published later, on the way back up
        return ended(outcome_);
      }
    }
  }
  // Most collectives finish within microseconds: poll briefly before sleeping.
  const auto spinUntil = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
  while (!done_.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < spinUntil) {
    sched_yield();
  }
  // Ended, but its own callbacks not run: they may be queued behind the one this wait is
  // in, on this very thread (operations that end in one turn of the send/recv engine).
  completeIfEnded();
  std::unique_lock<std::mutex> lock(mutex_);
  if (!bounded(timeout)) {
    cv_.wait(lock, [&] { return completed_; });
  } else if (!cv_.wait_for(lock, left(), [&] { return completed_; })) {
    timedOut(timeout);
  }
  return ended(exception_);
}

void WorkLoom::abort() {
  aborted_.store(true, std::memory_order_release);
  for (const Request& r : earlier_) r.cancel();
  awaited_.cancel();
}

void WorkLoom::waitOnHost(std::chrono::milliseconds timeout) {
  const trace::Span span("work wait on the host");
  const bool limited = bounded(timeout);
  const auto deadline =
      std::chrono::steady_clock::now() + (limited ? timeout : std::chrono::milliseconds(0));
  // Until the outcome is known, not just until the GPU is past the call: a failed call's
  // kernels, released, end on the GPU before loom has told this work that it failed.
  while (!done_.load(std::memory_order_acquire) && !failureSoFar()) {
    if (limited && std::chrono::steady_clock::now() >= deadline) {
      std::unique_lock<std::mutex> lock(mutex_);
      // Published since the check above: publish() looked at countedAsGivenUp_ under this
      // lock already, so counting the work as given up now would count it for good.
      if (done_.load(std::memory_order_acquire)) break;
      timedOut(timeout);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void WorkLoom::timedOut(std::chrono::milliseconds timeout) {
  if (ties_ && !countedAsGivenUp_) {
    countedAsGivenUp_ = true;
    ties_->givenUp.fetch_add(1);
  }
  C10_THROW_ERROR(DistBackendError,
                  "loom " + what_ + " #" + std::to_string(seq_) + " (rank " +
                      std::to_string(rank_) + "): work.wait() timed out after " +
                      std::to_string(timeout.count()) +
                      " ms; the operation itself goes on until its own timeout (or until "
                      "the group is destroyed, which aborts it)" +
                      (ties_ ? ties_->legend : std::string()));
}

c10::intrusive_ptr<c10::ivalue::Future> WorkLoom::getFuture() {
  if (cudaStream_) {
    std::call_once(futureOnce_, [&] {
      const c10::Device device = cudaStream_->device();
      auto future =
          c10::make_intrusive<c10::ivalue::Future>(futureTypeOf(futureLists_), std::vector{device});
      // Complete now, its own events recorded where the collectives' end is: on a stream
      // that waits for cudaEnd_, not on the loom stream, which may have taken later calls
      // (or, for a blocking call, the caller's later kernels) since.
      const c10::impl::VirtualGuardImpl impl(device.type());
      const c10::Stream marker = impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false);
      cudaEnd_->block(marker);
      c10::StreamGuard guard(marker);
      future->markCompleted(futureValueOf(outputs_, futureLists_));  // one list per rank, as on CPU
      future_ = std::move(future);
    });
    return future_;
  }
  // Asked on one of loom's threads before the call has ended: a callback chained on another
  // call's future runs there, and will wait on this one; a future's wait cannot run the
  // thread's queue, where this call may sit behind the very callback that asks (wait() can).
  if (!done_.load(std::memory_order_acquire) && awaited_.sequence() != 0 &&
      (Worker::current() != nullptr || detail::waitsMustDrive())) {
    try {
      // A Python callback asks with the GIL held: the process's other Python threads may be
      // what this call waits for (a peer reaches it only after one of them has run).
      releasingGil([&] { wait(); });
    } catch (...) {
      // Its outcome is the future's.
    }
    if (!future_->completed() && ended_.load(std::memory_order_acquire)) {
      // Ended, but published only once the thread is back up (complete()): a future of the
      // same outcome, complete now. (Not ended: aborted, and the future says so when it is.)
      auto now = c10::make_intrusive<c10::ivalue::Future>(futureTypeOf(futureLists_));
      if (outcome_) {
        now->setError(outcome_);
      } else {
        now->markCompleted(futureValueOf(outputs_, futureLists_));
      }
      return now;
    }
  }
  return future_;
}

}  // namespace loom::torch_plugin
