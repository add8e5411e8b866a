#pragma once

// Runs jobs one at a time, in submission order, on its own thread: a communicator's
// collectives complete in issue order while the caller goes on, and a collective across
// hosts hands its network work to threads of its own (network_context.h). After a job the
// thread spins briefly for the next (back-to-back jobs are common), then sleeps.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "util/backoff.h"

namespace loom {

class Worker {
 public:
  using Job = std::function<void()>;

  /// `name` names the thread (posix::nameThisThread).
  Worker(const char* name, BackoffPolicy backoff);
  /// Runs the jobs still queued, then stops the thread.
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Queues a job.
  void submit(Job job);
  /// Runs `job` on the calling thread if nothing is queued or running (so issue order
  /// holds) and returns true; returns false, running nothing, otherwise.
  template <class F>
  bool runHereIfIdle(F&& job) {
    // Without the mutex (two lock pairs were a tenth of a small call's instructions): claim
    // the worker, then make sure nothing was queued. submit() counts a job before queueing
    // it, and the worker checks here_ before taking one; with both sequentially consistent,
    // either this thread sees the count or the worker sees the claim.
    if (submitted_.load() != finished_.load()) return false;  // queued or running
    bool idle = false;
    if (!here_.compare_exchange_strong(idle, true)) return false;  // another caller's job
    if (submitted_.load() != finished_.load()) {
      release();
      return false;
    }
    job();
    release();
    return true;
  }
  /// Blocks until every job submitted so far has run.
  void drain();

 private:
  void run();
  // Ends a claim of runHereIfIdle and wakes the worker if jobs were queued meanwhile (only
  // then: waking it for nothing would cost two context switches per blocking collective).
  void release();
  BackoffPolicy backoff_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::deque<Job> queue_;               // guarded by mutex_
  bool stopping_ = false;               // guarded by mutex_
  std::atomic<bool> here_{false};       // a caller runs a job (runHereIfIdle)
  std::atomic<uint64_t> submitted_{0};  // jobs queued so far, counted before queueing
  std::atomic<uint64_t> finished_{0};   // jobs the worker has run
  std::thread thread_;
};

}  // namespace loom
