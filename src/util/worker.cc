// The collective worker thread.

#include "util/worker.h"

#include <sched.h>

#include "util/posix.h"

namespace loom {

Worker::Worker(const char* name, BackoffPolicy backoff)
    : backoff_(backoff), thread_([this, name] {
        posix::nameThisThread(name);
        run();
      }) {}

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void Worker::submit(Job job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Counted first: a caller about to run a job of its own (runHereIfIdle) must see it
    // before the worker can take it.
    submitted_.fetch_add(1);
    queue_.push_back(std::move(job));
  }
  wake_.notify_one();
}

void Worker::release() {
  here_.store(false);
  if (submitted_.load() == finished_.load()) return;
  // The worker may have seen the claim and be about to sleep: taking the mutex orders this
  // wake-up after its check.
  { std::lock_guard<std::mutex> lock(mutex_); }
  wake_.notify_one();
}

void Worker::drain() {
  const uint64_t target = submitted_.load(std::memory_order_acquire);
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [&] { return finished_.load(std::memory_order_acquire) >= target; });
}

void Worker::run() {
  for (;;) {
    // Spin for the next job first: a queue that just emptied often refills at once.
    Backoff backoff(backoff_);
    while (submitted_.load(std::memory_order_acquire) ==
           finished_.load(std::memory_order_relaxed)) {
      const auto stage = backoff.next();
      if (stage == Backoff::Stage::kSleep) break;
      if (stage == Backoff::Stage::kSpin)
        cpuRelax();
      else
        sched_yield();
    }
    Job job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // A caller may be running a job of its own (runHereIfIdle): wait until it is done.
      wake_.wait(lock, [&] { return (stopping_ || !queue_.empty()) && !here_.load(); });
      if (queue_.empty()) return;  // stopping, nothing left
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      finished_.fetch_add(1);
    }
    idle_.notify_all();
  }
}

}  // namespace loom
