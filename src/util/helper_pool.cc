// Fork-join over a small set of helper threads.

#include "util/helper_pool.h"

#include <sched.h>
#include <unistd.h>

#include <string>
#include <thread>

#include "util/futex.h"
#include "util/posix.h"
#include "util/trace.h"

namespace loom {

HelperPool& HelperPool::instance() {
  // Leaked on purpose (helpers never block process exit); per process, like ProcessService.
  static std::mutex mutex;
  static HelperPool* pool = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (pool == nullptr || owner != ::getpid()) {
    pool = new HelperPool();
    owner = ::getpid();
  }
  return *pool;
}

void HelperPool::ensureThreads(int helpers) {
  std::lock_guard<std::mutex> lock(growMutex_);
  while (static_cast<int>(threads_.size()) < helpers) {
    const int index = static_cast<int>(threads_.size()) + 1;  // the caller is part 0
    // The helper starts from the current generation, so it takes part in the region its
    // creator is about to publish even if it starts running only after the publication.
    const uint32_t start = generation_.load(std::memory_order_relaxed);
    std::thread helper([this, index, start] {
      posix::nameThisThread(("loom-helper-" + std::to_string(index)).c_str());
      helperLoop(index, start);
    });
    threads_.push_back(helper.native_handle());
    if (cpus_) ::pthread_setaffinity_np(threads_.back(), sizeof *cpus_, &*cpus_);
    helper.detach();
  }
  helperCount_ = static_cast<int>(threads_.size());
}

void HelperPool::bindTo(const cpu_set_t& cpus) {
  std::lock_guard<std::mutex> lock(growMutex_);
  cpus_ = cpus;
  // Best effort: a helper left where it was still runs, only not kept to the block.
  for (pthread_t helper : threads_) ::pthread_setaffinity_np(helper, sizeof cpus, &cpus);
}

void HelperPool::runErased(int parts, Thunk thunk, void* fn) {
  std::unique_lock<std::mutex> region(regionMutex_, std::try_to_lock);
  if (!region.owns_lock()) {
    for (int i = 0; i < parts; ++i) thunk(fn, i);
    return;
  }
  ensureThreads(parts - 1);
  thunk_ = thunk;
  fn_ = fn;
  parts_ = parts;
  // Every helper acknowledges every region, even those with no part in it, so none can
  // still be reading thunk_/parts_ when the next region overwrites them.
  remaining_.store(helperCount_, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_acq_rel);  // publishes the region
  if (sleepers_.load(std::memory_order_seq_cst) != 0) futexWakeAll(&generation_);
  thunk(fn, 0);
  const trace::Span span("wait for helpers", static_cast<uint64_t>(parts));
  Backoff backoff(backoff_);
  while (remaining_.load(std::memory_order_acquire) != 0) {
    if (backoff.next() == Backoff::Stage::kSpin)
      cpuRelax();
    else
      sched_yield();
  }
}

void HelperPool::helperLoop(int index, uint32_t seen) {
  for (;;) {
    Backoff backoff(backoff_);
    uint32_t now;
    while ((now = generation_.load(std::memory_order_acquire)) == seen) {
      switch (backoff.next()) {
        case Backoff::Stage::kSpin: cpuRelax(); break;
        case Backoff::Stage::kYield: sched_yield(); break;
        case Backoff::Stage::kSleep:
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          if (generation_.load(std::memory_order_seq_cst) == seen) {
            futexWait(&generation_, seen, backoff_.sleepSlice);
          }
          sleepers_.fetch_sub(1, std::memory_order_relaxed);
          break;
      }
    }
    seen = now;
    if (index < parts_) {
      const trace::Span span("helper part", static_cast<uint64_t>(index));
      thunk_(fn_, index);
    }
    remaining_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace loom
