#pragma once

// Runs jobs one at a time, in submission order, on its own thread: a communicator's
// collectives complete in issue order while the caller goes on, and a collective across
// hosts hands its network work to threads of its own (network_context.h). After a job the
// thread spins briefly for the next (back-to-back jobs are common), then sleeps.
//
// A job's completion callbacks run on the worker's thread, and a callback may issue another
// job and wait for it (torch's PowerSGD hook waits on an all_reduce inside a future's
// callback): queued behind the very job whose callback waits, it would never run. So a
// worker made to `serveItsOwnWaits` lets code on its thread run queued jobs itself, in
// order and only up to the one it needs (runQueuedHere), which is what the thread would have
// done next anyway; and a call issued from a callback runs before the issuing call returns,
// even one issued asynchronously. Jobs run so run their own callbacks inside the caller's, one
// level deeper each: with a long queue (PowerSGD over hundreds of buckets) that nesting would
// outgrow Python's recursion limit and the thread's stack. So from kMaxNesting levels down,
// what a job's completion would run (its callbacks, `defer`) waits until the job that the
// thread took from its queue itself has returned. A waiter that needs it sooner runs it
// (runDeferredHere); one that cannot (a torch future's wait) must not wait on a call that ran
// that deep on its behalf.
//
// A callback that waits for anything else that only comes after a later job (an event its
// caller sets after its next call, a later job's future taken before the callback ran)
// holds the queue for good, and the jobs behind it never start, so their own deadlines never
// begin. A worker told to watch such holds (watchHolds) keeps a thread that does: once the
// first job queued behind a callback has waited as long as the watch's patience, with no job
// run on the worker's thread meanwhile, it reports the hold (onHold) and gives up the queued
// jobs, and any submitted until the callback returns (each job's `abandon`, which ends it
// failed without running it). The jobs given up together all end before any of their own
// callbacks run, as a job's callbacks may wait for a later job.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

#include "util/backoff.h"

namespace loom {

class Worker {
 public:
  using Job = std::function<void()>;
  /// Ends a job failed without running it, and returns what must run after it (its own
  /// completion callbacks), once the jobs given up with it have ended too; or an empty Job.
  using Abandon = std::function<Job()>;

  /// `name` names the thread (posix::nameThisThread). `serveItsOwnWaits`: see above.
  Worker(const char* name, BackoffPolicy backoff, bool serveItsOwnWaits = false);
  /// Runs the jobs still queued, then stops the thread.
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Queues a job; returns its number (1, 2, ... in submission order). `abandon`, if given,
  /// ends the job without running it, should a hold give it up (on the watch's thread, or
  /// the submitter's); a job without one is never given up, and waits out the hold.
  uint64_t submit(Job job, Abandon abandon = nullptr);

  /// A hold, as reported: the tag of the callbacks that hold the queue (CallbackFrame), how
  /// long the first job queued behind them waited, and how many jobs were given up.
  struct Hold {
    uint64_t tag = 0;
    std::chrono::milliseconds waited{0};
    size_t jobs = 0;
  };
  /// Watches for callbacks that hold the queue (see above): `patience` says, when asked, how
  /// long a job may wait behind one; `onHold` runs on the watch's thread before the jobs are
  /// given up. Call before the first submit.
  void watchHolds(std::function<std::chrono::milliseconds()> patience,
                  std::function<void(const Hold&)> onHold);
  /// Marks completion callbacks running on current()'s thread (elsewhere it does nothing),
  /// for as long as it lives: the time a job waits behind them counts towards a hold.
  class CallbackFrame {
   public:
    explicit CallbackFrame(uint64_t tag);
    ~CallbackFrame();
    CallbackFrame(const CallbackFrame&) = delete;
    CallbackFrame& operator=(const CallbackFrame&) = delete;

   private:
    Worker* worker_;
    struct Frame {
      int64_t since;  // steady-clock ns; 0: a job, or nothing
      uint64_t id;
      uint64_t tag;
    } outer_{};
    friend class Worker;
  };
  /// The worker whose hold watch runs on the calling thread (it ends the calls a hold gave
  /// up, running their callbacks), or nullptr: such a thread is the worker's own, as its
  /// worker thread is (a shutdown there would wait for itself).
  static Worker* watchingHere();
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

  /// The worker made to serve its own waits whose thread calls this, or nullptr.
  static Worker* current();
  /// On current()'s thread: runs the queued jobs numbered up to `upTo` (default: those queued
  /// so far), in order; returns how many ran. Elsewhere runs nothing.
  size_t runQueuedHere(uint64_t upTo = 0);
  /// Nesting of runQueuedHere from which completions are deferred (see above).
  static constexpr int kMaxNesting = 8;
  /// True on current()'s thread kMaxNesting runQueuedHere levels deep: defer what would
  /// nest further.
  bool deep() const;
  /// On current()'s thread: runs `completion` once the thread is back at its own loop, or
  /// when a waiter calls runDeferredHere, whichever is first.
  void defer(std::function<void()> completion);
  /// On current()'s thread: runs the completions deferred so far, in order, until `enough`
  /// (if given) says so; returns how many ran. They run one level deeper (a completion that
  /// would nest further defers again).
  size_t runDeferredHere(const std::function<bool()>& enough = nullptr);

 private:
  void run();
  // Takes the next queued job if it was submitted as number `upTo` or earlier.
  bool takeNext(uint64_t upTo, std::function<void()>& job);
  // Counts a job as run and wakes drain().
  void finishedOne();
  // Ends a claim of runHereIfIdle and wakes the worker if jobs were queued meanwhile (only
  // then: waking it for nothing would cost two context switches per blocking collective).
  void release();
  using Frame = CallbackFrame::Frame;
  // The thread's innermost frame becomes callbacks tagged `tag` (`callbacks`), or a job;
  // returns the frame it replaces.
  Frame enterFrame(bool callbacks, uint64_t tag);
  // Restores the frame enterFrame replaced. Callbacks resumed after a job (which is the
  // queue moving) restart their clock; after callbacks nested in them, they keep it.
  void leaveFrame(const Frame& outer, bool leavingJob);
  // Wakes the watch's thread, if there is one, to time the jobs waiting behind callbacks
  // (mutex_ held).
  void pokeWatch();
  void watch();
  // Gives up the queued jobs of the hold of frame `frame` (mutex_ held on entry, released
  // while they end).
  void giveUp(std::unique_lock<std::mutex>& lock, uint64_t frame, int64_t from);
  struct Queued {
    uint64_t number;
    Job job;
    Abandon abandon;
    int64_t queuedAt;  // steady-clock nanoseconds
  };
  BackoffPolicy backoff_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable idle_;
  std::deque<Queued> queue_;  // guarded by mutex_
  const bool serveItsOwnWaits_;
  bool stopping_ = false;               // guarded by mutex_
  std::atomic<bool> here_{false};       // a caller runs a job (runHereIfIdle)
  std::atomic<uint64_t> submitted_{0};  // jobs queued so far, counted before queueing
  std::atomic<uint64_t> finished_{0};   // jobs the worker has run
  // One level of nesting for as long as it lives, whatever leaves it (a callback may throw).
  struct Level {
    explicit Level(int& depth) : depth_(depth) { ++depth_; }
    ~Level() { --depth_; }
    Level(const Level&) = delete;
    Level& operator=(const Level&) = delete;
    int& depth_;
  };
  int nesting_ = 0;                             // runQueuedHere levels; the worker's thread only
  std::deque<std::function<void()>> deferred_;  // defer()'s; the worker's thread only
  // The hold watch (watchHolds). The innermost frame of the worker's thread: callbacks
  // running since heldSince_ (steady-clock ns), numbered heldFrame_ (from 1), with tag
  // heldTag_; or a job or nothing (all 0).
  std::atomic<int64_t> heldSince_{0};
  std::atomic<uint64_t> heldFrame_{0};
  std::atomic<uint64_t> heldTag_{0};
  uint64_t frames_ = 0;            // callback frames entered; the worker's thread only
  std::atomic<size_t> queued_{0};  // queue_.size(), for a look without the mutex
  std::function<std::chrono::milliseconds()> patience_;
  std::function<void(const Hold&)> onHold_;
  std::condition_variable watchWake_;
  bool watchArmed_ = false;     // guarded by mutex_: jobs wait behind callbacks
  bool givingUp_ = false;       // guarded by mutex_: a hold's callbacks have not returned yet
  uint64_t givenUpFrame_ = 0;   // guarded by mutex_: the frame whose hold was given up
  bool watchStopping_ = false;  // guarded by mutex_: the destructor ends the watch
  std::thread watch_;
  std::thread thread_;
};

}  // namespace loom
