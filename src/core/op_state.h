#pragma once

// The shared state behind a Request: pending until the thread running the operation calls
// complete() exactly once, with nullptr (success) or the Error that ended it.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "util/fork_generation.h"

namespace loom {
class Worker;
}  // namespace loom

namespace loom::detail {

/// Told when one of its operations fails (a communicator's failure report); called on the
/// thread that completes the operation, before its waiters wake.
class FailureSink {
 public:
  virtual void operationFailed(const std::exception_ptr& failure) = 0;

 protected:
  ~FailureSink() = default;
};

/// A failure's message ("unknown failure" if it is not a std::exception).
std::string failureMessage(const std::exception_ptr& failure);

/// Marks the calling thread as an engine's own, whose operations nothing else moves while a
/// completion callback on it waits: a wait there never sleeps longer than a slice before it
/// drives its operation again (OpState::progress).
void markWaitsMustDrive();
/// Whether markWaitsMustDrive was called on this thread.
bool waitsMustDrive();

/// Marks the calling thread as the one that alone completes the operations whose `completer`
/// is `completer` (a CUDA executor's monitor): a completion callback there that waited for
/// one of them would wait for itself, so the wait is refused instead (Request::wait).
void markCompleting(const void* completer);
/// What markCompleting marked this thread with, or null.
const void* completingHere();

struct OpState {
  enum : int { kPending = 0, kDone = 1, kFailed = 2 };

  explicit OpState(uint64_t sequence = 0) : seq(sequence), issuedIn(forks::generation()) {}

  using Callbacks = std::vector<std::function<void(std::exception_ptr)>>;
  /// Finishes the operation, wakes waiters and runs completion callbacks (on this thread).
  void complete(std::exception_ptr failure);
  /// complete() in two halves, for several operations ended together: finish each (its
  /// waiters see it ended), then run their callbacks, so that no callback waits on one of
  /// them not marked yet.
  Callbacks finish(std::exception_ptr failure);
  /// Runs `callbacks` (of operation number `seq`, if known: a hold names it, see Worker).
  static void runCallbacks(Callbacks callbacks, const std::exception_ptr& failure,
                           uint64_t seq = 0);
  bool finished() const { return status.load(std::memory_order_acquire) != kPending; }
  /// For a waiter about to sleep or a callback about to be added: marks the state watched
  /// (complete() then wakes and calls back) and returns whether it has finished.
  bool finishedForWatcher();

  std::atomic<int> status{kPending};
  std::atomic<bool> watched{false};  ///< someone sleeps on `done` or added a callback
  std::exception_ptr error;          ///< set before status leaves kPending
  uint64_t seq;
  /// The fork generation of the process that issued it: a fork of that process must not
  /// drive nor wait for it (its engines' threads are not there, and its positions in the
  /// shared rings would part from the parent's).
  const uint64_t issuedIn;
  std::atomic<int> source{-1};  ///< receives: the rank the message came from
  /// Request::cancel asked the engine to end it (a send or receive not begun), or false.
  std::atomic<bool> cancelAsked{false};
  uint64_t flightId = 0;  ///< its entry in the flight record, or 0
  /// When it began to run (Request::startedAt); written before complete(), which publishes it.
  std::chrono::steady_clock::time_point startedAt{};
  FailureSink* sink = nullptr;  ///< told of a failure; outlives the operation
  std::mutex mutex;
  std::condition_variable done;
  std::vector<std::function<void(std::exception_ptr)>> callbacks;  ///< guarded by mutex
  /// Set (before the operation is queued) where a waiter may move the operation on itself
  /// instead of waiting for the thread that runs it: one turn of that engine, true if it
  /// did anything (false if another thread is in one). Sends and receives on CPU tensors.
  /// `slept`: the waiter slept a slice, and ends the engine's operations past their
  /// deadlines too (its thread may be inside a completion callback, where it watches none).
  std::function<bool(bool slept)> progress;
  /// Set where the operation waits in a worker's queue (a collective issued asynchronously):
  /// the worker and the job's number there. A waiter on that worker's own thread (a
  /// completion callback) runs the queue up to it (Worker::runQueuedHere).
  Worker* queuedOn = nullptr;
  uint64_t queuedAs = 0;
  /// Set where one thread alone completes the operation (CUDA calls: their executor's
  /// monitor), to that thread's mark (markCompleting).
  const void* completer = nullptr;
};

}  // namespace loom::detail
