#pragma once

// Helper threads that split one rank's large copies and reductions. One pool per process,
// one parallel region at a time: a caller that finds the pool busy (another communicator's
// worker) simply runs its parts itself. Idle helpers spin briefly, then sleep on a futex.

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "util/backoff.h"

namespace loom {

class HelperPool {
 public:
  /// This process's pool (a forked child gets its own).
  static HelperPool& instance();

  /// Calls fn(i) for every i in [0, parts), spread over up to `parts` threads including the
  /// caller; returns when all calls have returned. fn must not throw.
  template <class F>
  void run(int parts, F&& fn) {
    if (parts <= 1) {
      if (parts == 1) fn(0);
      return;
    }
    auto thunk = [](void* f, int i) { (*static_cast<std::remove_reference_t<F>*>(f))(i); };
    runErased(parts, thunk, static_cast<void*>(&fn));
  }

  /// Keeps every helper, those running and those started later, to the CPUs of `cpus`.
  void bindTo(const cpu_set_t& cpus);

 private:
  using Thunk = void (*)(void*, int);
  HelperPool() = default;
  void runErased(int parts, Thunk thunk, void* fn);
  void ensureThreads(int helpers);
  void helperLoop(int index, uint32_t seen);

  std::mutex regionMutex_;  // one region at a time
  std::mutex growMutex_;
  std::vector<pthread_t> threads_;  // the helpers (detached, never ending), to bind them
  std::optional<cpu_set_t> cpus_;   // where helpers run, once bound (under growMutex_)
  // The current region, published by bumping generation_ (release) and read by helpers
  // after they acquire it.
  Thunk thunk_ = nullptr;
  void* fn_ = nullptr;
  int parts_ = 0;
  int helperCount_ = 0;  // threads started; written under regionMutex_ (via ensureThreads)
  alignas(64) std::atomic<uint32_t> generation_{0};
  alignas(64) std::atomic<int> remaining_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  BackoffPolicy backoff_{std::chrono::microseconds(50), std::chrono::microseconds(50),
                         std::chrono::milliseconds(100)};
};

}  // namespace loom
