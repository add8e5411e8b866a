// The collective worker thread.

#include "util/worker.h"

#include <sched.h>

#include "util/posix.h"

namespace loom {

namespace {
thread_local Worker* tCurrent = nullptr;  // the worker serving its own waits on this thread
}  // namespace

Worker::Worker(const char* name, BackoffPolicy backoff, bool serveItsOwnWaits)
    : backoff_(backoff), serveItsOwnWaits_(serveItsOwnWaits), thread_([this, name] {
        posix::nameThisThread(name);
        if (serveItsOwnWaits_) tCurrent = this;
        run();
      }) {}

Worker* Worker::current() {
  return tCurrent;
}

Worker::~Worker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

uint64_t Worker::submit(Job job) {
  uint64_t number = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Counted first: a caller about to run a job of its own (runHereIfIdle) must see it
    // before the worker can take it.
    number = submitted_.fetch_add(1) + 1;
    queue_.emplace_back(number, std::move(job));
  }
  wake_.notify_one();
  return number;
}

void Worker::release() {
  here_.store(false);
  if (submitted_.load() == finished_.load()) return;
  // The worker may have seen the claim and be about to sleep: taking the mutex orders this
  // wake-up after its check.
  { std::lock_guard<std::mutex> lock(mutex_); }
  wake_.notify_one();
}

void Worker::finishedOne() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    finished_.fetch_add(1);
  }
  idle_.notify_all();
}

bool Worker::takeNext(uint64_t upTo, std::function<void()>& job) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (queue_.empty() || queue_.front().first > upTo) return false;
  job = std::move(queue_.front().second);
  queue_.pop_front();
  return true;
}

size_t Worker::runQueuedHere(uint64_t upTo) {
  if (tCurrent != this) return 0;
  // Jobs that these jobs' callbacks queue, or other threads queue meanwhile, were issued
  // after the caller's own (or the job it waits for) and wait for it.
  if (upTo == 0) upTo = submitted_.load();
  size_t ran = 0;
  const Level level(nesting_);
  for (Job job; takeNext(upTo, job); ++ran) {
    try {
      job();
    } catch (...) {
      finishedOne();  // a completion callback threw through its job: still one less queued
      throw;
    }
    finishedOne();
  }
  return ran;
}

bool Worker::deep() const {
  return tCurrent == this && nesting_ >= kMaxNesting;
}

void Worker::defer(std::function<void()> completion) {
  deferred_.push_back(std::move(completion));
}

size_t Worker::runDeferredHere(const std::function<bool()>& enough) {
  if (tCurrent != this) return 0;
  size_t ran = 0;
  const Level level(nesting_);
  // Taken one at a time: a completion may defer more.
  for (; !deferred_.empty() && !(enough && enough()); ++ran) {
    std::function<void()> completion = std::move(deferred_.front());
    deferred_.pop_front();
    completion();
  }
  return ran;
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
      job = std::move(queue_.front().second);
      queue_.pop_front();
    }
    job();
    runDeferredHere();  // back at the top: what deep levels deferred runs here, shallow
    finishedOne();
  }
}

}  // namespace loom
