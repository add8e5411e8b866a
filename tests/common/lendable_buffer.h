#pragma once

// A test or benchmark buffer from the heap, or from the lending pool (as torch's
// allocate_tensor gives), where the peers of large all_gathers and reduce_scatters read it
// in place.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "transport/shm/lending.h"

namespace loom::testing {

class LendableBuffer {
 public:
  /// Empty until resize(); `lent`: from the lending pool.
  explicit LendableBuffer(bool lent) : lent_(lent) {}
  LendableBuffer(size_t bytes, bool lent) : lent_(lent) { resize(bytes); }
  ~LendableBuffer() {
    if (lent_ && data_ != nullptr) shm::LendingPool::instance().release(data_);
  }
  LendableBuffer(const LendableBuffer&) = delete;
  LendableBuffer& operator=(const LendableBuffer&) = delete;

  /// Makes it `bytes` long (once; the contents are undefined).
  void resize(size_t bytes) {
    size_ = bytes;
    if (bytes == 0) return;
    if (lent_) {
      data_ = static_cast<uint8_t*>(shm::LendingPool::instance().allocate(bytes));
    } else {
      heap_.resize(bytes);
      data_ = heap_.data();
    }
  }
  uint8_t* data() { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  bool lent_;
  std::vector<uint8_t> heap_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace loom::testing
