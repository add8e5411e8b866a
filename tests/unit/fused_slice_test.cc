// The fused kernels' slices, checked on the host: in every step of a call, the blocks' slices
// cover the step's elements exactly once, evenly, and each block's slice lies inside the one
// it has in the call's first step, so a block never writes region bytes that another block
// of the receiver frees (found on four H200s: a short last step's slices, cut from its own
// size, corrupted all_gather and reduce_scatter of 3M floats).

#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/kernel_params.h"

namespace loom::cuda {
namespace {

void checkCall(uint64_t count, uint64_t perStep, int blocks, uint64_t vector) {
  SCOPED_TRACE("count " + std::to_string(count) + ", perStep " + std::to_string(perStep) +
               ", blocks " + std::to_string(blocks) + ", vector " + std::to_string(vector));
  for (uint64_t lo = 0; lo < count || lo == 0; lo += perStep) {
    const uint64_t n = count - lo < perStep ? count - lo : perStep;
    uint64_t next = 0;  // slices come in block order, each starting where the last ended
    const uint64_t first = count < perStep ? count : perStep;
    for (int b = 0; b < blocks; ++b) {
      const FusedSlice s = fusedSlice(first, n, blocks, b, vector);
      const FusedSlice full = fusedSlice(first, first, blocks, b, vector);
      ASSERT_EQ(s.from, next) << "block " << b;
      ASSERT_LE(s.from, s.to);
      // Balanced: no block takes more than its even share of the first step, rounded up
      // to a vector (a call smaller than a step is not left to a few blocks).
      ASSERT_LE(s.to - s.from, (first + blocks - 1) / blocks + vector) << "block " << b;
      if (s.from < s.to) {
        ASSERT_GE(s.from, full.from) << "block " << b << " moved in a short step";
        ASSERT_LE(s.to, full.to) << "block " << b << " moved in a short step";
        ASSERT_EQ(s.from % vector, 0u) << "unaligned slice";
      }
      next = s.to;
    }
    ASSERT_EQ(next, n) << "the blocks leave elements out";
    if (count == 0) break;
  }
}

TEST(FusedSlice, EveryStepIsCoveredOnceAndSlicesStayPut) {
  // 3M floats at P = 4 with the default chunk: the case that failed on the GPUs.
  checkCall(3'000'000, (2 * (uint64_t{8} << 20) / 3) / 16 * 16 / 4, 64, 4);
  for (uint64_t vector : {1, 2, 4, 8, 16}) {
    for (int blocks : {1, 3, 42, 64}) {
      for (uint64_t perStep : {uint64_t{16}, uint64_t{1000}, uint64_t{65536}, uint64_t{1398100}}) {
        for (uint64_t count : {uint64_t{0}, uint64_t{1}, perStep - 1, perStep, 2 * perStep + 7,
                               5 * perStep + perStep / 3}) {
          checkCall(count, perStep, blocks, vector);
        }
      }
    }
  }
}

}  // namespace
}  // namespace loom::cuda
