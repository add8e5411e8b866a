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
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!queue_.empty() || running_) return false;
      running_ = true;
    }
    job();
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      running_ = false;
      wake = !queue_.empty() || stopping_;
    }
    // Only jobs queued meanwhile need the worker; waking it for nothing would cost two
    // context switches per blocking collective.
    if (wake) wake_.notify_one();
    return true;
  }
  /// Blocks until every job submitted so far has run.
  void drain();

 private:
  void run();
  BackoffPolicy backoff_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::deque<Job> queue_;  // guarded by mutex_
  bool running_ = false;   // a job is running (here or on a caller); mutex_
  bool stopping_ = false;  // guarded by mutex_
  std::atomic<uint64_t> submitted_{0};
  std::atomic<uint64_t> finished_{0};
  std::thread thread_;
};

}  // namespace loom
