#pragma once

// Which bytes a strided tensor covers, exactly: for telling whether a call still writing one
// view of a storage writes bytes another view reads (a halo exchange receives into one column
// of a grid while it sends another, whose byte ranges interleave without sharing a byte).

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace loom::torch_plugin {

/// Where a tensor's elements lie, kept apart from the tensor (which it does not keep alive).
struct TensorBytes {
  const uint8_t* first = nullptr;  ///< the element at index 0
  size_t elementBytes = 0;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;  ///< in elements, possibly negative or zero
  bool dense = false;            ///< its elements fill their extent, each once
  /// `t`'s layout.
  static TensorBytes of(const at::Tensor& t);
};

/// Whether `a` and `b` share any byte. Exact where each is a slice of a contiguous tensor in
/// any order (its dimensions nested: each stride spans the dimensions within it), at any size,
/// or is at most kMostRuns contiguous runs of elements; beyond that, whether their extents
/// overlap (never a false "no").
bool shareBytes(const TensorBytes& a, const TensorBytes& b);

/// Runs past which shareBytes stops enumerating a layout that is not nested and answers from
/// the extents.
inline constexpr size_t kMostRuns = size_t{1} << 16;

}  // namespace loom::torch_plugin
