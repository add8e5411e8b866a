// Fork-join over a small set of helper threads, with pieces that any thread of the region
// may claim.

#include "util/helper_pool.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <thread>
#include <utility>

#include "util/futex.h"
#include "util/posix.h"
#include "util/trace.h"

namespace loom {

namespace {

constexpr int kMaxPieces = 0xffff;  // a share's bounds are 16-bit fields of its word

constexpr uint64_t shareWord(uint32_t generation, int next, int end) {
  return uint64_t{generation} << 32 | static_cast<uint64_t>(next) << 16 |
         static_cast<uint64_t>(end);
}

}  // namespace

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
    const int index = static_cast<int>(threads_.size()) + 1;  // the caller is thread 0
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
}

void HelperPool::bindTo(const cpu_set_t& cpus) {
  std::lock_guard<std::mutex> lock(growMutex_);
  cpus_ = cpus;
  // Best effort: a helper left where it was still runs, only not kept to the block.
  for (pthread_t helper : threads_) ::pthread_setaffinity_np(helper, sizeof cpus, &cpus);
}

void HelperPool::runErased(int threads, int pieces, Thunk thunk, void* fn) {
  std::unique_lock<std::mutex> region(regionMutex_, std::try_to_lock);
  if (!region.owns_lock() || pieces > kMaxPieces) {
    for (int i = 0; i < pieces; ++i) thunk(fn, i);
    return;
  }
  threads = std::min({threads, pieces, kMaxThreads});
  ensureThreads(threads - 1);
  // No thread of the last region holds a piece (all were done), so none reads these now.
  thunk_ = thunk;
  fn_ = fn;
  failed_.store(false, std::memory_order_relaxed);
  failure_ = nullptr;
  done_.store(0, std::memory_order_relaxed);
  regionThreads_.store(threads, std::memory_order_relaxed);
  const uint32_t generation = generation_.load(std::memory_order_relaxed) + 1;
  for (int t = 0; t < threads; ++t) {
    const int begin = static_cast<int>(int64_t{pieces} * t / threads);
    const int end = static_cast<int>(int64_t{pieces} * (t + 1) / threads);
    shares_[t].word.store(shareWord(generation, begin, end), std::memory_order_release);
  }
  generation_.store(generation, std::memory_order_seq_cst);  // publishes the region
  if (sleepers_.load(std::memory_order_seq_cst) != 0) futexWakeAll(&generation_);
  work(0, generation);
  const trace::Span span("wait for helpers", static_cast<uint64_t>(threads));
  Backoff backoff(backoff_);
  while (done_.load(std::memory_order_acquire) != pieces) {
    if (backoff.next() == Backoff::Stage::kSpin)
      cpuRelax();
    else
      sched_yield();
  }
  // Every piece is counted: no thread holds one, so the region's failure is this caller's.
  if (failed_.load(std::memory_order_relaxed)) std::rethrow_exception(std::exchange(failure_, {}));
}

void HelperPool::drain(Share& share, uint32_t generation) {
  uint64_t word = share.word.load(std::memory_order_acquire);
  for (;;) {
    const auto next = static_cast<int>(word >> 16 & 0xffff);
    if (static_cast<uint32_t>(word >> 32) != generation || next >= static_cast<int>(word & 0xffff))
      return;
    if (!share.word.compare_exchange_weak(word, word + (uint64_t{1} << 16),
                                          std::memory_order_acquire)) {
      continue;  // `word` now holds what another thread left
    }
    // The claimed piece keeps the region open, so thunk_ and fn_ are this region's. A piece
    // that throws is still counted (the caller must not return while another runs), and its
    // exception waits for the caller.
    try {
      thunk_(fn_, next);
    } catch (...) {
      if (!failed_.exchange(true, std::memory_order_relaxed)) failure_ = std::current_exception();
    }
    // Last touch of the region: once every piece is counted, the caller may return.
    done_.fetch_add(1, std::memory_order_release);
    word = share.word.load(std::memory_order_acquire);
  }
}

void HelperPool::work(int own, uint32_t generation) {
  // Read without ordering: a value from another region only makes the loop look at shares
  // whose generation then does not match.
  const int threads = regionThreads_.load(std::memory_order_relaxed);
  drain(shares_[own], generation);
  for (int k = 1; k < threads; ++k) drain(shares_[(own + k) % threads], generation);
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
    // A helper without a share in this region (the region wanted fewer threads) steals
    // nothing either: the caller chose that many threads for the size.
    const uint64_t own = shares_[index].word.load(std::memory_order_relaxed);
    if (static_cast<uint32_t>(own >> 32) != now) continue;
    const trace::Span span("helper part", static_cast<uint64_t>(index));
    work(index, now);
  }
}

}  // namespace loom
