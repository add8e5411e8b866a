// The collective worker thread.

#include "util/worker.h"

#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <system_error>
#include <vector>

#include "util/posix.h"

namespace loom {

namespace {
thread_local Worker* tCurrent = nullptr;   // the worker serving its own waits on this thread
thread_local Worker* tWatching = nullptr;  // the worker whose hold watch this thread is

constexpr int64_t kHourNs = int64_t{3600} * 1'000'000'000;

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
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
  // The watch stops only now: a hold while the queue drains above still needs it.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    watchStopping_ = true;
  }
  watchWake_.notify_one();
  if (watch_.joinable()) watch_.join();
}

uint64_t Worker::submit(Job job, Abandon abandon) {
  uint64_t number = 0;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // Counted first: a caller about to run a job of its own (runHereIfIdle) must see it
    // before the worker can take it.
    number = submitted_.fetch_add(1) + 1;
    const bool stillGivenUp = givingUp_ && heldFrame_.load() == givenUpFrame_;
    if (stillGivenUp && abandon) {
      // Behind callbacks whose hold was given up already, and which still hold the queue.
      lock.unlock();
      if (Job then = abandon()) then();
      finishedOne();
      return number;
    }
    givingUp_ = stillGivenUp;
    queue_.push_back({number, std::move(job), std::move(abandon), onHold_ ? nowNs() : 0});
    queued_.store(queue_.size());
    if (heldSince_.load() != 0) pokeWatch();
  }
  wake_.notify_one();
  return number;
}

void Worker::watchHolds(std::function<std::chrono::milliseconds()> patience,
                        std::function<void(const Hold&)> onHold) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Made now, with the worker, not at the first job queued behind callbacks: that happens
  // whenever a call is issued while a callback of a quick one runs, and a thread made then
  // (its stack, its malloc arena) would outlive the communicator in the process's caches.
  try {
    watch_ = std::thread([this] {
      posix::nameThisThread("loom-watch");
      tWatching = this;
      watch();
    });
  } catch (const std::system_error&) {
    return;  // no thread to be had (a pids limit): holds go unwatched, as before the watch
  }
  patience_ = std::move(patience);
  onHold_ = std::move(onHold);
}

Worker* Worker::watchingHere() {
  return tWatching;
}

Worker::CallbackFrame::CallbackFrame(uint64_t tag) : worker_(Worker::current()) {
  if (worker_ != nullptr) outer_ = worker_->enterFrame(true, tag);
}

Worker::CallbackFrame::~CallbackFrame() {
  if (worker_ != nullptr) worker_->leaveFrame(outer_, /*leavingJob=*/false);
}

Worker::Frame Worker::enterFrame(bool callbacks, uint64_t tag) {
  const Frame outer{heldSince_.load(), heldFrame_.load(), heldTag_.load()};
  const int64_t since = callbacks ? nowNs() : 0;
  heldTag_.store(callbacks ? tag : 0);
  heldFrame_.store(callbacks ? ++frames_ : 0);
  heldSince_.store(since);
  // Jobs queued before the callbacks began wait behind them from now on. (One queued after
  // this look pokes the watch itself: it reads heldSince_ after queueing.)
  if (since != 0 && queued_.load() != 0 && onHold_) {
    std::lock_guard<std::mutex> lock(mutex_);
    pokeWatch();
  }
  return outer;
}

void Worker::leaveFrame(const Frame& outer, bool leavingJob) {
  heldTag_.store(outer.tag);
  heldFrame_.store(outer.id);
  heldSince_.store(leavingJob && outer.since != 0 ? nowNs() : outer.since);
}

void Worker::pokeWatch() {
  if (!onHold_ || watchArmed_) return;
  watchArmed_ = true;
  watchWake_.notify_one();
}

void Worker::watch() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!watchStopping_) {
    const int64_t since = heldSince_.load();
    const uint64_t frame = heldFrame_.load();
    if (!watchArmed_ || since == 0 || queue_.empty() || (givingUp_ && frame == givenUpFrame_)) {
      // Nothing waits behind callbacks: sleep until a job does (pokeWatch).
      watchArmed_ = false;
      watchWake_.wait(lock, [&] { return watchStopping_ || watchArmed_; });
      continue;
    }
    // The first queued job has waited since it was queued or since the callbacks began (or
    // resumed after a job ran on their thread), whichever is later. Saturating: a timeout
    // of milliseconds::max() (deadline.h's "never") must not wrap into "at once".
    const int64_t from = std::max(since, queue_.front().queuedAt);
    const int64_t patienceMs = std::max<int64_t>(patience_().count(), 0);
    const int64_t deadline =
        patienceMs >= (INT64_MAX - from) / 1'000'000 ? INT64_MAX : from + patienceMs * 1'000'000;
    if (const int64_t left = deadline - nowNs(); left > 0) {
      // At most an hour at a time: a patience of centuries must not overflow the wait.
      watchWake_.wait_for(lock, std::chrono::nanoseconds(std::min<int64_t>(left, kHourNs)));
      continue;  // looked at again: the callbacks may have returned, the queue moved
    }
    giveUp(lock, frame, from);
  }
}

void Worker::giveUp(std::unique_lock<std::mutex>& lock, uint64_t frame, int64_t from) {
  const Hold hold{heldTag_.load(),
                  std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::nanoseconds(nowNs() - from)),
                  queue_.size()};
  watchArmed_ = false;
  // Reported before any job is given up, so that each one's end can say why. Nothing may
  // leave this thread by an exception (it would end the process).
  lock.unlock();
  try {
    onHold_(hold);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom: reporting a held queue failed: %s\n", e.what());
  }
  lock.lock();
  if (heldFrame_.load() != frame) return;  // the callbacks returned meanwhile: the queue moves
  // Jobs without an abandon wait on (they must run on the worker's thread).
  std::deque<Queued> jobs;
  std::deque<Queued> kept;
  for (Queued& q : queue_) (q.abandon ? jobs : kept).push_back(std::move(q));
  queue_.swap(kept);
  queued_.store(queue_.size());
  givingUp_ = true;
  givenUpFrame_ = frame;
  lock.unlock();
  // Every job ended before any callback of theirs runs: a callback may wait for a job given
  // up after its own, which only this thread ends now.
  std::vector<Job> thens;
  thens.reserve(jobs.size());
  for (Queued& q : jobs) {
    try {
      thens.push_back(q.abandon());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "loom: ending a call a held queue gave up failed: %s\n", e.what());
      thens.emplace_back();
    }
  }
  for (Job& then : thens) {
    try {
      if (then) then();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "loom: ending a call a held queue gave up failed: %s\n", e.what());
    }
    finishedOne();
  }
  lock.lock();
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
  if (queue_.empty() || queue_.front().number > upTo) return false;
  job = std::move(queue_.front().job);
  queue_.pop_front();
  queued_.store(queue_.size());
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
    // A job, not callbacks, is the thread's innermost frame while it runs.
    const Frame outer = enterFrame(false, 0);
    try {
      job();
    } catch (...) {
      leaveFrame(outer, /*leavingJob=*/true);
      finishedOne();  // a completion callback threw through its job: still one less queued
      throw;
    }
    leaveFrame(outer, /*leavingJob=*/true);
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
    const CallbackFrame frame(0);  // a completion's callbacks, for a hold's watch
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
      job = std::move(queue_.front().job);
      queue_.pop_front();
      queued_.store(queue_.size());
    }
    job();
    runDeferredHere();  // back at the top: what deep levels deferred runs here, shallow
    finishedOne();
  }
}

}  // namespace loom
