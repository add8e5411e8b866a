// The CUDA path's choices from where the ranks sit (core/cuda_paths.h), checked on the host:
// a GPU per rank, ranks taking turns on one GPU, the same under MPS, layouts in between, and
// what the LOOM_CUDA_* settings force.

#include "core/cuda_paths.h"

#include <gtest/gtest.h>

#include <vector>

namespace loom::detail {
namespace {

// An H200's fused blocks at once (132 SMs, two 512-thread blocks each).
constexpr int kResident = 264;

CudaPaths pathsFor(const std::vector<int>& devices, bool mps, const CudaTuning& tuning = {}) {
  return chooseCudaPaths(tuning, devices, mps, kResident, true);
}

TEST(CudaPaths, AGpuPerRankFusesEverySizeOnTwoStreams) {
  for (const bool mps : {false, true}) {
    const CudaPaths p = pathsFor({0, 1, 2, 3}, mps);
    EXPECT_EQ(p.crowd, 1);
    EXPECT_TRUE(p.fused);
    EXPECT_EQ(p.fusedMostBytes, SIZE_MAX);
    EXPECT_TRUE(p.pipelined);
    EXPECT_EQ(p.oneShotBytes, kOneShotBytes);
    EXPECT_EQ(p.fusedBlocks, cuda::kMaxFusedBlocks);
    EXPECT_EQ(p.twoShotBlocks, cuda::kMaxTwoShotBlocks);
    EXPECT_FALSE(p.takingTurns);
  }
  // Two ranks reduce one-shot at every size.
  EXPECT_EQ(pathsFor({0, 1}, false).oneShotBytes, SIZE_MAX);
}

TEST(CudaPaths, RanksTakingTurnsOnOneGpuStepOnOneStreamAndAreToldOfMps) {
  const CudaPaths p = pathsFor({0, 0, 0}, false);
  EXPECT_EQ(p.crowd, 3);
  EXPECT_TRUE(p.takingTurns);
  EXPECT_FALSE(p.fused);
  EXPECT_FALSE(p.pipelined);
  EXPECT_EQ(p.oneShotBytes, SIZE_MAX);
}

TEST(CudaPaths, UnderMpsSmallCollectivesFuseAndStepsTakeTwoStreams) {
  const CudaPaths p = pathsFor({0, 0, 0, 0}, true);
  EXPECT_FALSE(p.takingTurns);
  EXPECT_TRUE(p.fused);
  EXPECT_EQ(p.fusedMostBytes, CudaTuning{}.fusedSharedGpuBytes);
  EXPECT_TRUE(p.pipelined);
  EXPECT_EQ(p.oneShotBytes, SIZE_MAX);
  // Each rank's grids fit beside the three others': a quarter of the resident blocks.
  EXPECT_LE(4 * 2 * p.fusedBlocks, kResident);
  EXPECT_LE(4 * 3 * p.twoShotBlocks, kResident);
  CudaTuning tuning;
  tuning.fusedSharedGpuBytes = 4096;
  EXPECT_EQ(pathsFor({0, 0}, true, tuning).fusedMostBytes, 4096u);
}

TEST(CudaPaths, SomeRanksSharingAGpuWithoutMpsTakeTheStepsWithTwoStreams) {
  // Two GPUs, two ranks on each: the pairs take turns, so no spinning kernels; the steps
  // still alternate streams, as with a GPU per rank (not measured on such a layout).
  const CudaPaths p = pathsFor({0, 0, 1, 1}, false);
  EXPECT_EQ(p.crowd, 2);
  EXPECT_TRUE(p.takingTurns);
  EXPECT_FALSE(p.fused);
  EXPECT_TRUE(p.pipelined);
  EXPECT_EQ(p.oneShotBytes, kOneShotBytes);
  EXPECT_TRUE(pathsFor({0, 0, 1, 1}, true).fused);
}

TEST(CudaPaths, SettingsForceTheirChoiceWhereverTheRanksSit) {
  CudaTuning on;
  on.fused = true;
  on.pipelined = true;
  on.oneShotBytes = 0;
  const CudaPaths forced = pathsFor({0, 0, 0}, false, on);
  EXPECT_TRUE(forced.fused);
  EXPECT_EQ(forced.fusedMostBytes, SIZE_MAX);  // forced on: every size
  EXPECT_TRUE(forced.pipelined);
  EXPECT_EQ(forced.oneShotBytes, 0u);
  CudaTuning off;
  off.fused = false;
  off.pipelined = false;
  for (const std::vector<int>& devices : {std::vector<int>{0, 1}, std::vector<int>{0, 0}}) {
    const CudaPaths p = pathsFor(devices, true, off);
    EXPECT_FALSE(p.fused);
    EXPECT_FALSE(p.pipelined);
  }
  CudaTuning few;
  few.fusedBlocks = 8;
  EXPECT_EQ(pathsFor({0, 1}, false, few).fusedBlocks, 8);
}

TEST(CudaPaths, NoFusedCallWhereTheGridsCannotAllBePlaced) {
  // A GPU that does not fit a fused call, and one whose resident blocks, shared by 32 ranks,
  // leave each fewer than three.
  EXPECT_FALSE(chooseCudaPaths({}, std::vector<int>{0, 1}, false, kResident, false).fused);
  const std::vector<int> crowded(32, 0);
  EXPECT_FALSE(chooseCudaPaths({}, crowded, true, 64, true).fused);
  EXPECT_TRUE(chooseCudaPaths({}, crowded, true, 96, true).fused);
}

TEST(CudaPaths, TransfersFuseOnlyWhereAGridForEveryPeerBothWaysFitsTheShare) {
  // A fused transfer runs a block per stream at least, a stream per peer and direction, in
  // at most two roles of fusedBlocks, which the share bounds. On one H200 under MPS (264
  // resident blocks), up to 12 ranks fit; from 13 the collectives still fuse, the transfers
  // take the steps.
  for (int ranks = 2; ranks <= 16; ++ranks) {
    const std::vector<int> oneGpu(static_cast<size_t>(ranks), 0);
    const CudaPaths p = pathsFor(oneGpu, true);
    EXPECT_TRUE(p.fused) << ranks;
    EXPECT_EQ(p.fusedTransfers, 2 * (ranks - 1) <= 2 * p.fusedBlocks) << ranks;
    EXPECT_EQ(p.fusedTransfers, ranks <= 12) << ranks;
    // Every rank's widest transfer grid placed at once.
    if (p.fusedTransfers) {
      EXPECT_LE(ranks * 2 * (ranks - 1), kResident) << ranks;
    }
  }
  // A GPU per rank: every transfer fuses; where the collectives do not, neither do they.
  EXPECT_TRUE(pathsFor({0, 1, 2, 3}, false).fusedTransfers);
  EXPECT_FALSE(pathsFor({0, 0, 0}, false).fusedTransfers);
  CudaTuning off;
  off.fused = false;
  EXPECT_FALSE(pathsFor({0, 1}, false, off).fusedTransfers);
}

}  // namespace
}  // namespace loom::detail
