#pragma once

// Deterministic test inputs and an independent, element-by-element reference for every
// reduction: the semantics loom documents (rank order 0..size-1, half types accumulated in
// float32 and rounded once, integer AVG in int64, wrapping integer SUM and PRODUCT, NaN-
// propagating MIN and MAX), written plainly so that a kernel bug cannot hide in shared code.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/types.h"

namespace loom::testing {

/// Fills `out` (count elements of `type`) with rank `rank`'s input for test case `salt`:
/// small values (multiples of 1/8 in [-4, 4], integers in [-4, 4]) that every type holds
/// exactly. Results are compared bit for bit: the reference rounds exactly where loom does.
void fillInput(void* out, DataType type, size_t count, int rank, uint32_t salt, size_t offset = 0);

/// Expected result of reducing the inputs of ranks 0..size-1 with `op`.
std::vector<uint8_t> referenceReduce(DataType type, ReduceOp op, size_t count, int size,
                                     uint32_t salt, size_t offset = 0);

/// Expected bytes of rank `rank`'s input (fillInput into a new vector).
std::vector<uint8_t> inputBytes(DataType type, size_t count, int rank, uint32_t salt,
                                size_t offset = 0);

/// Empty if the two buffers are equal, else a description of the first difference.
std::string firstDifference(const void* got, const void* want, DataType type, size_t count);

/// Empty if an all_gather output (`size` blocks of `count` elements, block q holding rank
/// q's input for `salt`) is right, else which block differs first and how.
std::string allGatherDifference(const void* out, DataType type, size_t count, int size,
                                uint32_t salt);

/// All data types, and the reductions each supports, for sweeps.
std::vector<DataType> allTypes();
std::vector<ReduceOp> reductionsFor(DataType type);

}  // namespace loom::testing
