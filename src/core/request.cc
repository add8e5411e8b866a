// Request: waiting on and polling an operation.

#include "loom/request.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <utility>

#include "core/flight_recorder.h"
#include "core/op_state.h"
#include "loom/error.h"
#include "util/backoff.h"
#include "util/deadline.h"
#include "util/worker.h"

namespace loom {

namespace detail {

std::string failureMessage(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown failure";
  }
}

void OpState::complete(std::exception_ptr failure) {
  runCallbacks(finish(failure), failure, seq);
}

OpState::Callbacks OpState::finish(std::exception_ptr failure) {
  // The record and the failure report come first: a waiter that wakes may end the process.
  if (flightId != 0)
    FlightRecorder::instance().ended(flightId, failure ? failureMessage(failure) : "");
  if (failure && sink != nullptr) sink->operationFailed(failure);
  error = failure;  // read only by those who see the status below
  status.store(failure ? kFailed : kDone);
  // Nobody asleep and no callbacks (the common case, a waiter that spins): no lock. Both
  // sides are sequentially consistent, so either this thread sees `watched` or the watcher,
  // who sets it before looking, sees the status.
  if (!watched.load()) return {};
  Callbacks run;
  {
    std::lock_guard<std::mutex> lock(mutex);
    run.swap(callbacks);
  }
  done.notify_all();
  return run;
}

namespace {

// Runs one completion callback. They run on loom's threads (a worker, the send/recv engine),
// where an exception would end the process, or inside an unrelated call on the caller's
// thread: one that throws is reported and dropped, and the callbacks after it still run.
void runOne(const std::function<void(std::exception_ptr)>& callback,
            const std::exception_ptr& failure) noexcept {
  try {
    callback(failure);
  } catch (...) {
    std::fprintf(stderr,
                 "loom: a completion callback (Request::onComplete) threw, and its exception "
                 "was dropped: %s; callbacks must not throw\n",
                 failureMessage(std::current_exception()).c_str());
  }
}

}  // namespace

void OpState::runCallbacks(Callbacks run, const std::exception_ptr& failure, uint64_t seq) {
  if (run.empty()) return;
  // A call that a completion callback ran on its worker's thread (Worker::runQueuedHere),
  // many levels down: its own callbacks wait until the thread is back up.
  if (Worker* worker = Worker::current(); worker != nullptr && worker->deep()) {
    worker->defer([run = std::move(run), failure, seq] {
      const Worker::CallbackFrame frame(seq);
      for (auto& callback : run) runOne(callback, failure);
    });
    return;
  }
  // On a worker's thread the calls queued behind these callbacks wait for them (see Worker).
  const Worker::CallbackFrame frame(seq);
  for (auto& callback : run) runOne(callback, failure);
}

namespace {
thread_local bool tWaitsMustDrive = false;
}  // namespace

void markWaitsMustDrive() {
  tWaitsMustDrive = true;
}

bool waitsMustDrive() {
  return tWaitsMustDrive;
}

namespace {
thread_local const void* tCompleting = nullptr;
}  // namespace

void markCompleting(const void* completer) {
  tCompleting = completer;
}

const void* completingHere() {
  return tCompleting;
}

bool OpState::finishedForWatcher() {
  watched.store(true);
  return status.load() != kPending;
}

}  // namespace detail

namespace {

// Spin briefly (a collective often finishes within microseconds), then block.
const BackoffPolicy kWaitPolicy{std::chrono::microseconds(20), std::chrono::microseconds(100),
                                std::chrono::milliseconds(100)};

// A pending operation of the process this one was forked from: refused by name (`what`),
// where a wait would hang (no thread here completes it) or drive the parent's engine.
void refuseInAFork(const detail::OpState& state, const char* what) {
  if (state.issuedIn == forks::generation() || state.finished()) return;
  throw Error(ErrorCode::kUnsupported, what, -1,
              "this operation was issued by the process this one is a fork of: a forked "
              "process cannot wait for, nor cancel, its parent's operations; make a "
              "communicator of its own (init_process_group in the child)");
}

bool settle(detail::OpState& state, std::chrono::steady_clock::time_point deadline) {
  refuseInAFork(state, "wait");
  if (state.completer != nullptr && state.completer == detail::completingHere() &&
      !state.finished()) {
    throw Error(ErrorCode::kInvalidArgument, "wait", -1,
                "waited for a CUDA operation inside a completion callback of the same "
                "communicator's CUDA operations: the thread running the callback is the one "
                "that completes them, so the wait would never end; wait from another thread, "
                "or chain another callback (Request::onComplete)");
  }
  std::optional<Backoff> backoff(std::in_place, kWaitPolicy);
  bool slept = false;  // a slice, since the operation was last driven
  while (!state.finished()) {
    // A completion callback on the worker's thread whose queue holds this operation: the
    // queue would move only after it returns (see Worker), so it runs it up to this one.
    if (state.queuedOn != nullptr && state.queuedOn == Worker::current() &&
        state.queuedOn->runQueuedHere(state.queuedAs) > 0) {
      backoff.emplace(kWaitPolicy);
      continue;
    }
    // Where the operation lets its waiter drive it (sends and receives), doing so saves
    // handing each step to the engine's thread and back: two wake-ups a message, each a
    // scheduler turn on a machine whose cores the ranks fill. The backoff restarts whenever
    // the turn did something, so a transfer is driven here to its end.
    if (state.progress && state.progress(std::exchange(slept, false))) {
      backoff.emplace(kWaitPolicy);
      continue;
    }
    switch (backoff->next()) {
      case Backoff::Stage::kSpin: cpuRelax(); break;
      case Backoff::Stage::kYield: sched_yield(); break;
      case Backoff::Stage::kSleep: {
        if (state.finishedForWatcher()) break;
        // Watched now: complete() takes the mutex before notifying, so the checks under it
        // see the status.
        std::unique_lock<std::mutex> lock(state.mutex);
        // On an engine's own thread (a completion callback there) nothing else moves the
        // operation: sleep a slice, then drive it again. Elsewhere the engine's thread moves
        // it, unless a callback holds that thread: then only waiters see its deadline pass,
        // so they look every few milliseconds.
        if (state.progress) {
          const auto slice = std::chrono::steady_clock::now() +
                             std::chrono::milliseconds(detail::waitsMustDrive() ? 1 : 10);
          state.done.wait_until(lock, std::min(deadline, slice), [&] { return state.finished(); });
          slept = true;
        } else if (deadline == std::chrono::steady_clock::time_point::max()) {
          state.done.wait(lock, [&] { return state.finished(); });
        } else if (!state.done.wait_until(lock, deadline, [&] { return state.finished(); })) {
          return false;
        }
        break;
      }
    }
    if (std::chrono::steady_clock::now() >= deadline && !state.finished()) return false;
  }
  return true;
}

}  // namespace

bool Request::test() const {
  return !state_ || state_->finished();
}

void Request::wait() const {
  if (!state_) return;
  settle(*state_, std::chrono::steady_clock::time_point::max());
  if (state_->status.load(std::memory_order_acquire) == detail::OpState::kFailed) {
    std::rethrow_exception(state_->error);
  }
}

bool Request::waitFor(std::chrono::milliseconds timeout) const {
  if (!state_) return true;
  if (!settle(*state_, deadlineAfter(timeout))) return false;
  if (state_->status.load(std::memory_order_acquire) == detail::OpState::kFailed) {
    std::rethrow_exception(state_->error);
  }
  return true;
}

std::exception_ptr Request::error() const {
  if (!state_ || state_->status.load(std::memory_order_acquire) != detail::OpState::kFailed) {
    return nullptr;
  }
  return state_->error;
}

uint64_t Request::sequence() const {
  return state_ ? state_->seq : 0;
}

int Request::sourceRank() const {
  return state_ ? state_->source.load() : -1;
}

std::chrono::steady_clock::time_point Request::startedAt() const {
  return state_ ? state_->startedAt : std::chrono::steady_clock::time_point{};
}

void Request::cancel() const {
  if (!state_ || state_->finished()) return;
  refuseInAFork(*state_, "cancel");
  state_->cancelAsked.store(true, std::memory_order_release);
  // A turn of its engine that ends it now, unless a thread is in one: then the engine's
  // next look at its operations' deadlines does.
  if (state_->progress) state_->progress(/*slept=*/true);
}

void Request::onComplete(std::function<void(std::exception_ptr)> callback) const {
  if (!state_) {
    callback(nullptr);
    return;
  }
  if (!state_->finishedForWatcher()) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    // Checked again under the mutex: complete() takes it to collect the callbacks.
    if (!state_->finished()) {
      state_->callbacks.push_back(std::move(callback));
      return;
    }
  }
  callback(error());
}

}  // namespace loom
