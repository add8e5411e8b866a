#pragma once

// Waiting without burning a core: spin (cheap, lowest latency), then yield (lets another
// runnable thread have the core), then sleep (the caller's futex or condition variable).

#include <chrono>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace loom {

/// Tells the core we are spinning (PAUSE on x86, YIELD on Arm).
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

/// How long each stage lasts; from LOOM_SPIN_US and LOOM_YIELD_US (see env.h).
struct BackoffPolicy {
  std::chrono::nanoseconds spin{std::chrono::microseconds(20)};
  std::chrono::nanoseconds yield{std::chrono::microseconds(200)};
  /// Longest single sleep, so deadlines and failures are re-checked at least this often.
  std::chrono::nanoseconds sleepSlice{std::chrono::milliseconds(50)};
};

/// One wait's progress through the stages. Call next() once per unsuccessful poll.
class Backoff {
 public:
  enum class Stage { kSpin, kYield, kSleep };
  explicit Backoff(const BackoffPolicy& policy) : policy_(policy) {}

  /// The stage for this poll; reads the clock only every 64 polls.
  Stage next() {
    if (stage_ == Stage::kSleep) return stage_;
    if ((++polls_ & 63) == 0) {
      const auto now = std::chrono::steady_clock::now();
      if (polls_ == 64) start_ = now;
      const auto waited = now - start_;
      if (waited >= policy_.spin + policy_.yield)
        stage_ = Stage::kSleep;
      else if (waited >= policy_.spin)
        stage_ = Stage::kYield;
    }
    return stage_;
  }

 private:
  const BackoffPolicy& policy_;
  Stage stage_ = Stage::kSpin;
  uint64_t polls_ = 0;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace loom
