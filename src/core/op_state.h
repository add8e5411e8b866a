#pragma once

// The shared state behind a Request: pending until the thread running the operation calls
// complete() exactly once, with nullptr (success) or the Error that ended it.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <vector>

namespace loom::detail {

struct OpState {
  enum : int { kPending = 0, kDone = 1, kFailed = 2 };

  explicit OpState(uint64_t sequence = 0) : seq(sequence) {}

  /// Finishes the operation, wakes waiters and runs completion callbacks (on this thread).
  void complete(std::exception_ptr failure);
  bool finished() const { return status.load(std::memory_order_acquire) != kPending; }

  std::atomic<int> status{kPending};
  std::exception_ptr error;  ///< set before status leaves kPending
  uint64_t seq;
  std::atomic<int> source{-1};  ///< receives: the rank the message came from
  std::mutex mutex;
  std::condition_variable done;
  std::vector<std::function<void(std::exception_ptr)>> callbacks;  ///< guarded by mutex
};

}  // namespace loom::detail
