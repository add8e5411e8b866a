#pragma once

// One value per rank, for the tables an algorithm builds on every call (reduction sources,
// copy tasks). Held inline up to kInline ranks, so a call on a communicator of one host's
// size allocates nothing: a vector's allocation and release cost about 150 instructions of
// a small call's 2,300 (callgrind, world size 1). On the heap beyond kInline ranks.

#include <algorithm>
#include <cstddef>
#include <memory>
#include <span>
#include <type_traits>

namespace loom {

template <class T>
class PerRank {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>,
                "PerRank holds plain values (pointers, sizes, copy tasks)");

 public:
  static constexpr size_t kInline = 64;

  /// `ranks` values, each T{}.
  explicit PerRank(size_t ranks)
      : size_(ranks),
        heap_(ranks > kInline ? std::make_unique<T[]>(ranks) : nullptr),
        data_(heap_ ? heap_.get() : inline_) {
    if (!heap_) std::fill_n(inline_, ranks, T{});
  }
  // data_ may point into this object: neither copied nor moved.
  PerRank(const PerRank&) = delete;
  PerRank& operator=(const PerRank&) = delete;

  T& operator[](size_t i) { return data_[i]; }
  /// The first `n` values (a table filled only in part).
  std::span<const T> first(size_t n) const { return {data_, n}; }
  /// All of them, as the copy and reduction helpers take them.
  operator std::span<const T>() const { return {data_, size_}; }

 private:
  size_t size_;
  T inline_[kInline];
  std::unique_ptr<T[]> heap_;
  T* data_;
};

}  // namespace loom
