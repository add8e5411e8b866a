#pragma once

// A single-producer single-consumer byte stream in shared memory: the sender advances
// `head`, the receiver advances `tail`, both as running byte counts (they never wrap; the
// data area is indexed modulo its power-of-two size). A release store of head after the
// copy, paired with the reader's acquire load, makes the bytes visible before the count;
// likewise tail hands space back to the writer.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "transport/shm/layout.h"

namespace loom::shm {

/// The sending end of a ring.
class RingWriter {
 public:
  RingWriter(RingControl& control, uint8_t* data, size_t capacity)
      : control_(&control),
        data_(data),
        mask_(capacity - 1),
        head_(control.head.load(std::memory_order_relaxed)) {}

  /// Copies as much of [src, src + n) as fits and returns how many bytes that was.
  size_t write(const void* src, size_t n) {
    const uint64_t tail = control_->tail.load(std::memory_order_acquire);
    const size_t space = mask_ + 1 - static_cast<size_t>(head_ - tail);
    n = std::min(n, space);
    if (n == 0) return 0;
    const size_t at = static_cast<size_t>(head_) & mask_;
    const size_t first = std::min(n, mask_ + 1 - at);
    std::memcpy(data_ + at, src, first);
    std::memcpy(data_, static_cast<const uint8_t*>(src) + first, n - first);
    head_ += n;
    control_->head.store(head_, std::memory_order_release);
    return n;
  }

 private:
  RingControl* control_;
  uint8_t* data_;
  size_t mask_;
  uint64_t head_;
};

/// The receiving end of a ring.
class RingReader {
 public:
  RingReader(RingControl& control, uint8_t* data, size_t capacity)
      : control_(&control),
        data_(data),
        mask_(capacity - 1),
        tail_(control.tail.load(std::memory_order_relaxed)) {}

  /// Bytes written and not yet consumed.
  size_t available() const {
    return static_cast<size_t>(control_->head.load(std::memory_order_acquire) - tail_);
  }

  /// Moves up to n available bytes to dst (nullptr discards them); returns how many.
  size_t read(void* dst, size_t n) {
    n = std::min(n, available());
    if (n == 0) return 0;
    if (dst != nullptr) {
      const size_t at = static_cast<size_t>(tail_) & mask_;
      const size_t first = std::min(n, mask_ + 1 - at);
      std::memcpy(dst, data_ + at, first);
      std::memcpy(static_cast<uint8_t*>(dst) + first, data_, n - first);
    }
    tail_ += n;
    control_->tail.store(tail_, std::memory_order_release);
    return n;
  }

 private:
  RingControl* control_;
  uint8_t* data_;
  size_t mask_;
  uint64_t tail_;
};

}  // namespace loom::shm
