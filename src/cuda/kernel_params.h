#pragma once

// The arguments of loom's CUDA kernels (src/cuda/kernels.cu), shared by the kernels and
// the host code that launches them. Plain structs passed by value as the kernel's one
// parameter; no CUDA header needed.

#include <cstdint>

namespace loom::cuda {

/// Most sources one reduction reads (ranks of one host sharing the work).
inline constexpr int kMaxSources = 32;
/// Most segments one copy launch moves.
inline constexpr int kMaxSegments = 32;

/// dst[i] = op over s = 0..nsrc-1, in that order, of srcs[s][i], for i < count; the
/// element type and op are in the kernel's name (loom_reduce_<type>_<op>, enum values).
struct ReduceParams {
  void* dst;
  const void* srcs[kMaxSources];
  int nsrc;
  uint64_t count;
  double factor;                   ///< PREMUL_SUM's factor
  double divisor;                  ///< AVG's: the number of ranks
  const volatile uint64_t* abort;  ///< nonzero: the communicator failed; do nothing
};

/// One contiguous copy.
struct Segment {
  void* dst;
  const void* src;
  uint64_t bytes;
};

/// Copies every segment (blockIdx.y picks the segment): loom_copy.
struct CopyParams {
  Segment segments[kMaxSegments];
  int count;
  const volatile uint64_t* abort;
};

}  // namespace loom::cuda
