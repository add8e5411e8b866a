#pragma once

// Deadlines that cannot wrap: a timeout of milliseconds::max() (or any timeout past the
// clock's end) means "never", not a deadline in the past.

#include <chrono>

namespace loom {

/// `from` + timeout, saturating at the clock's last time point.
inline std::chrono::steady_clock::time_point deadlineAfter(
    std::chrono::milliseconds timeout, std::chrono::steady_clock::time_point from) {
  using Clock = std::chrono::steady_clock;
  if (timeout.count() <= 0) return from;
  const auto room =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::time_point::max() - from);
  return timeout >= room ? Clock::time_point::max() : from + timeout;
}

/// steady_clock::now() + timeout, saturating at the clock's last time point.
inline std::chrono::steady_clock::time_point deadlineAfter(std::chrono::milliseconds timeout) {
  return deadlineAfter(timeout, std::chrono::steady_clock::now());
}

}  // namespace loom
