#pragma once

// Cross-process futex calls on 32-bit words in shared memory (FUTEX_WAIT/WAKE without the
// PRIVATE flag, so sleepers in other processes are found).

#include <atomic>
#include <chrono>
#include <cstdint>

namespace loom {

/// Sleeps while *word == expected, at most `timeout`. Returns on wake, timeout, signal or
/// when the value already differs; callers re-check their condition.
void futexWait(const std::atomic<uint32_t>* word, uint32_t expected,
               std::chrono::nanoseconds timeout);

/// Wakes every sleeper on `word`.
void futexWakeAll(const std::atomic<uint32_t>* word);

/// The low 32 bits of a 64-bit counter, as a futex word (x86-64 and aarch64 are
/// little-endian: the low half sits at the counter's address).
inline const std::atomic<uint32_t>* lowWord(const std::atomic<uint64_t>* counter) {
  static_assert(sizeof(std::atomic<uint64_t>) == 8 && sizeof(std::atomic<uint32_t>) == 4);
  return reinterpret_cast<const std::atomic<uint32_t>*>(counter);
}

}  // namespace loom
