#pragma once

// Many device copies as one kernel launch: the tensor store copies a few hundred tensors
// between a writer's buffer and a reader's tensors every refresh, where a launch per tensor,
// or a batched kernel that gives every tensor the same share of the GPU, leaves it idle.

#include <cuda.h>

#include <span>

#include "cuda/kernel_params.h"

namespace loom::cuda {

/// Queues dst = src for every piece on `stream`, a stream of device `device`'s primary
/// context (torch's): pieces of `aloneBytes` or more each as the driver's own copy
/// (cuMemcpyDtoDAsync, the fastest for one large piece), the rest in one launch per
/// kMaxSpreadPieces pieces with their bytes spread evenly over the blocks. Pieces must not
/// overlap one another's destinations.
void copySpread(int device, CUstream stream, std::span<const Segment> pieces, uint64_t aloneBytes);

}  // namespace loom::cuda
