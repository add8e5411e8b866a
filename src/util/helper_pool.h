#pragma once

// Helper threads that split one rank's large copies and reductions. One pool per process,
// one parallel region at a time: a caller that finds the pool busy (another communicator's
// worker) simply runs its pieces itself. Idle helpers spin briefly, then sleep on a futex.

#include <pthread.h>
#include <sched.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <vector>

#include "util/backoff.h"

namespace loom {

class HelperPool {
 public:
  /// The most threads (the caller included) one region runs on.
  static constexpr int kMaxThreads = 256;

  /// This process's pool (a forked child gets its own).
  static HelperPool& instance();

  /// Calls fn(i) for every i in [0, pieces), on up to `threads` threads including the caller,
  /// and returns when all calls have returned. Thread t begins with its own share of the
  /// pieces (a contiguous run, in order); a thread done with its share takes pieces no thread
  /// has begun, so a helper that wakes late holds up no one. If a call throws, the first
  /// exception is rethrown here once no call of the region is running (other pieces may or
  /// may not have run).
  template <class F>
  void run(int threads, int pieces, F&& fn) {
    if (threads <= 1 || pieces <= 1) {
      for (int i = 0; i < pieces; ++i) fn(i);
      return;
    }
    auto thunk = [](void* f, int i) { (*static_cast<std::remove_reference_t<F>*>(f))(i); };
    runErased(threads, pieces, thunk, static_cast<void*>(&fn));
  }

  /// Keeps every helper, those running and those started later, to the CPUs of `cpus`.
  void bindTo(const cpu_set_t& cpus);

 private:
  using Thunk = void (*)(void*, int);
  // One thread's share of a region's pieces: (generation << 32) | (next << 16) | end. A
  // piece is claimed by raising `next` with a compare-and-swap that also checks the
  // generation, so a helper that arrives after its region ended claims nothing.
  struct alignas(64) Share {
    std::atomic<uint64_t> word{0};
  };

  HelperPool() = default;
  void runErased(int threads, int pieces, Thunk thunk, void* fn);
  void ensureThreads(int helpers);
  void helperLoop(int index, uint32_t seen);
  /// Runs pieces of `share` of region `generation` until none is left.
  void drain(Share& share, uint32_t generation);
  /// Drains the region's shares, own share first, then the others from the next one on.
  void work(int own, uint32_t generation);

  std::mutex regionMutex_;  // one region at a time
  std::mutex growMutex_;
  std::vector<pthread_t> threads_;  // the helpers (detached, never ending), to bind them
  std::optional<cpu_set_t> cpus_;   // where helpers run, once bound (under growMutex_)
  // The current region. thunk_ and fn_ are read only by a thread holding a claimed piece,
  // which keeps the region (and them) alive until the piece is done.
  Thunk thunk_ = nullptr;
  void* fn_ = nullptr;
  // The region's first exception: set by the thread whose claim of `failed_` succeeds,
  // before it counts its piece, so the caller reads it after seeing every piece counted.
  std::atomic<bool> failed_{false};
  std::exception_ptr failure_;
  alignas(64) std::atomic<int> regionThreads_{0};    // shares in the current region
  alignas(64) std::atomic<uint32_t> generation_{0};  // bumped to publish a region
  alignas(64) std::atomic<int> done_{0};             // pieces of the region finished
  alignas(64) std::atomic<int> sleepers_{0};
  std::array<Share, kMaxThreads> shares_{};
  BackoffPolicy backoff_{std::chrono::microseconds(50), std::chrono::microseconds(50),
                         std::chrono::milliseconds(100)};
};

}  // namespace loom
