#pragma once

// What the parts of the CUDA executor share: cuda_executor.cc (workspace, flags, agreement,
// launches, queueing, failures), cuda_fused.cc (the fused kernels' launches) and
// cuda_collectives.cc (the collectives and transfers, as steps). Internal to those files.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "core/cuda_descriptors.h"
#include "core/cuda_executor.h"

namespace loom::detail {

inline size_t roundDown(size_t v, size_t to) {
  return v / to * to;
}
/// How many of the `n` elements from `lo` lie below `count`.
inline size_t clipped(size_t count, size_t lo, size_t n) {
  return lo >= count ? 0 : std::min(n, count - lo);
}
inline const uint8_t* at(const void* p, size_t bytes) {
  return static_cast<const uint8_t*>(p) + bytes;
}
inline uint8_t* at(void* p, size_t bytes) {
  return static_cast<uint8_t*>(p) + bytes;
}

// Fixed-capacity lists for one step (no allocation per step): a segment per rank and one
// more (a root's own block), a source per rank.
struct CudaExecutor::Segments {
  std::array<cuda::Segment, cuda::kMaxSources + 1> items;
  size_t n = 0;
  void add(void* dst, const void* src, size_t bytes) { items[n++] = {dst, src, bytes}; }
  operator std::span<const cuda::Segment>() const { return {items.data(), n}; }
};
struct CudaExecutor::Sources {
  std::array<const void*, cuda::kMaxSources> items;
  int n = 0;
  void add(const void* src) { items[static_cast<size_t>(n++)] = src; }
};

template <class Body>
void CudaExecutor::steps(size_t count, size_t perStep, Body&& body) {
  const size_t n = count == 0 ? 1 : (count + perStep - 1) / perStep;
  // Not in a capture: a stream forked into one stays in it until the capture ends, so
  // the second stream could not serve the eager calls that may come meanwhile.
  const bool twoStreams = paths_.pipelined && !lane_->onDevice && n > 1;
  const CUstream caller = stream_;
  if (twoStreams) fork();
  try {
    for (size_t i = 0; i < n; ++i) {
      // Both parities' chains start here; each goes on in its own stream's order.
      stream_ = twoStreams && i % 2 == 1 ? side_ : caller;
      const uint64_t e = beginStep();
      body(i * perStep, e);
      signal(kDone, e);
    }
  } catch (...) {
    stream_ = caller;
    if (twoStreams) joinAfterFailure();
    throw;
  }
  stream_ = caller;
  if (twoStreams) join();
}

template <class Main, class Side>
void CudaExecutor::alongside(Main&& main, Side&& side) {
  // Forked first: the second stream starts where the call does, not after main's work.
  fork();
  const CUstream caller = stream_;
  try {
    main();
    stream_ = side_;
    side();
  } catch (...) {
    stream_ = caller;
    joinAfterFailure();
    throw;
  }
  stream_ = caller;
  join();
}

}  // namespace loom::detail
