#pragma once

// Deadlines that cannot wrap: a timeout of milliseconds::max() (or any timeout past the
// clock's end) means "never", not a deadline in the past.

#include <chrono>

namespace loom {

/// steady_clock::now() + timeout, saturating at the clock's last time point.
inline std::chrono::steady_clock::time_point deadlineAfter(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto now = Clock::now();
  if (timeout.count() <= 0) return now;
  const auto room =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - now);
  return timeout >= room ? Clock::time_point::max() : now + timeout;
}

}  // namespace loom
