// The collective worker thread.

#include "util/worker.h"

#include <sched.h>

#include <algorithm>
#include <tuple>

#include "util/posix.h"

namespace loom {

namespace {
thread_local Worker* tCurrent = nullptr;  // the worker serving its own waits on this thread

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
  watchWake_.notify_one();
  if (watch_.joinable()) watch_.join();
}

uint64_t Worker::submit(Job job, Job abandon) {
  uint64_t number = 0;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // Counted first: a caller about to run a job of its own (runHereIfIdle) must see it
    // before the worker can take it.
    number = submitted_.fetch_add(1) + 1;
    if (givingUp_ && heldSince_.load() == givenUpSince_) {
      // Behind callbacks whose hold was given up already, and which still hold the queue.
      lock.unlock();
      (abandon ? abandon : job)();
      finishedOne();
      return number;
    }
    givingUp_ = false;
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
  patience_ = std::move(patience);
  onHold_ = std::move(onHold);
}

Worker::CallbackFrame::CallbackFrame(uint64_t tag) : worker_(Worker::current()) {
  if (worker_ == nullptr) return;
  std::tie(outerSince_, outerTag_) = worker_->enterFrame(nowNs(), tag);
}

Worker::CallbackFrame::~CallbackFrame() {
  if (worker_ != nullptr) worker_->leaveFrame({outerSince_, outerTag_});
}

std::pair<int64_t, uint64_t> Worker::enterFrame(int64_t since, uint64_t tag) {
  const std::pair<int64_t, uint64_t> outer{heldSince_.load(), heldTag_.load()};
  heldTag_.store(tag);
  heldSince_.store(since);
  // Jobs queued before the callbacks began wait behind them from now on. (One queued after
  // this look pokes the watch itself: it reads heldSince_ after queueing.)
  if (since != 0 && queued_.load() != 0 && onHold_) {
    std::lock_guard<std::mutex> lock(mutex_);
    pokeWatch();
  }
  return outer;
}

void Worker::leaveFrame(std::pair<int64_t, uint64_t> outer) {
  enterFrame(outer.first == 0 ? 0 : nowNs(), outer.second);
}

void Worker::pokeWatch() {
  if (!onHold_ || watchArmed_) return;
  watchArmed_ = true;
  if (!watch_.joinable()) {
    watch_ = std::thread([this] {
      posix::nameThisThread("loom-watch");
      watch();
    });
  }
  watchWake_.notify_one();
}

void Worker::watch() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    const int64_t since = heldSince_.load();
    if (!watchArmed_ || since == 0 || queue_.empty() || givingUp_) {
      // Nothing waits behind callbacks: sleep until a job does (pokeWatch).
      watchArmed_ = false;
      watchWake_.wait(lock, [&] { return stopping_ || watchArmed_; });
      continue;
    }
    // The first queued job has waited since it was queued or since the callbacks began (or
    // resumed after a job ran on their thread), whichever is later.
    const int64_t from = std::max(since, queue_.front().queuedAt);
    const auto patience = std::chrono::duration_cast<std::chrono::nanoseconds>(patience_());
    const int64_t deadline = from + std::min<int64_t>(patience.count(), INT64_MAX - from);
    if (const int64_t left = deadline - nowNs(); left > 0) {
      // At most an hour at a time: a patience of centuries must not overflow the wait.
      watchWake_.wait_for(lock, std::chrono::nanoseconds(std::min<int64_t>(left, kHourNs)));
      continue;  // looked at again: the callbacks may have returned, the queue moved
    }
    giveUp(lock, since);
  }
}

void Worker::giveUp(std::unique_lock<std::mutex>& lock, int64_t since) {
  std::deque<Queued> jobs;
  jobs.swap(queue_);
  queued_.store(0);
  givingUp_ = true;
  givenUpSince_ = since;
  watchArmed_ = false;
  const Hold hold{heldTag_.load(),
                  std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::nanoseconds(nowNs() - std::max(since, jobs.front().queuedAt))),
                  jobs.size()};
  lock.unlock();
  onHold_(hold);
  for (Queued& q : jobs) {
    (q.abandon ? q.abandon : q.job)();
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
    const auto outer = enterFrame(0, 0);
    try {
      job();
    } catch (...) {
      leaveFrame(outer);
      finishedOne();  // a completion callback threw through its job: still one less queued
      throw;
    }
    leaveFrame(outer);
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
