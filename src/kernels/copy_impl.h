#pragma once

// The streaming copy, written once and compiled per instruction set (like reduce_impl.h).
// The including file defines, before including, a struct Lane in an anonymous namespace:
//   static constexpr size_t kBytes;              // bytes per vector
//   static Vec load(const uint8_t* src);         // unaligned load
//   static void stream(uint8_t* dst, Vec v);     // non-temporal store, dst kBytes-aligned
// and then calls streamWith<Lane>(dst, src, n).

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace {

template <class Lane>
void streamWith(void* dst, const void* src, size_t n) {
  constexpr size_t kStep = 4 * Lane::kBytes;  // four vectors in flight per iteration
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  // Plain stores up to the first vector boundary of the destination, streaming after.
  const size_t misalign = reinterpret_cast<uintptr_t>(d) % Lane::kBytes;
  const size_t head = std::min<size_t>(n, (Lane::kBytes - misalign) % Lane::kBytes);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    const auto a = Lane::load(s + i);
    const auto b = Lane::load(s + i + Lane::kBytes);
    const auto c = Lane::load(s + i + 2 * Lane::kBytes);
    const auto e = Lane::load(s + i + 3 * Lane::kBytes);
    Lane::stream(d + i, a);
    Lane::stream(d + i + Lane::kBytes, b);
    Lane::stream(d + i + 2 * Lane::kBytes, c);
    Lane::stream(d + i + 3 * Lane::kBytes, e);
  }
  std::memcpy(d + i, s + i, n - i);
  _mm_sfence();  // streaming stores are weakly ordered: fence before anyone is told
}

}  // namespace
