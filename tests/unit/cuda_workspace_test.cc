// The CUDA workspace's data layout (core/cuda_workspace.h): its parts follow each other
// without overlap for every chunk and rank count, and the chained broadcast's steps fit
// in the eager lane's slots. Plain C++: the executor that uses it needs a GPU.

#include "core/cuda_workspace.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace loom::detail {
namespace {

TEST(WorkspaceLayout, PartsFollowEachOtherWithoutOverlap) {
  for (size_t chunk : {size_t{64} << 10, size_t{1} << 20, size_t{8} << 20, size_t{1} << 30}) {
    for (int ranks = 1; ranks <= cuda::kMaxSources; ++ranks) {
      const WorkspaceLayout l = workspaceLayout(chunk, ranks);
      EXPECT_EQ(l.eagerMailSlot, chunk);
      EXPECT_EQ(l.graphMailSlot, std::max<size_t>(chunk / 4, 4096));
      EXPECT_EQ(l.graphMailSlot % 16, 0u);
      EXPECT_GE(l.eagerSlots, kDataOffset);
      EXPECT_GE(l.graphSlots, l.eagerSlots + kEagerSlots * 2 * chunk) << chunk << " " << ranks;
      EXPECT_GE(l.eagerMailboxes, l.graphSlots + kGraphSlots * 2 * chunk);
      EXPECT_GE(l.graphMailboxes, l.eagerMailboxes + static_cast<size_t>(ranks) * 2 * chunk);
      EXPECT_GE(l.blockFlags, l.graphMailboxes + static_cast<size_t>(ranks) * 2 * l.graphMailSlot);
      EXPECT_EQ(l.transferFlags, l.blockFlags + kBlockFlagsBytes);
      EXPECT_EQ(l.transferTable, l.transferFlags + kTransferFlagsBytes);
      EXPECT_EQ(l.bytes, l.transferTable + kTransferTableBytes);
      EXPECT_EQ(l.blockFlags % 8, 0u);      // 64-bit flags
      EXPECT_EQ(l.transferFlags % 16, 0u);  // flags, then 16-byte descriptors
      EXPECT_EQ(l.transferTable % 8, 0u);
    }
  }
}

// A chained broadcast keeps a step of a chunk in each half of the eager slots, and the
// stepped path's two slots are the first of them.
TEST(WorkspaceLayout, EagerSlotsHoldTheChainsStepsAndTheSteppedPathsTwo) {
  const size_t chunk = size_t{8} << 20;
  const WorkspaceLayout l = workspaceLayout(chunk, 4);
  EXPECT_GE(kEagerSlots, 2u);
  EXPECT_EQ(l.graphSlots - l.eagerSlots, 2 * kEagerSlots * chunk);
}

// docs/CONFIGURATION.md (LOOM_CUDA_CHUNK_BYTES): about 96 MiB + 20 MiB per rank by default.
TEST(WorkspaceLayout, DefaultSizeIsWhatTheDocsSay) {
  const size_t chunk = size_t{8} << 20;
  for (int ranks : {2, 4, 8}) {
    const size_t bytes = workspaceLayout(chunk, ranks).bytes;
    const size_t said = (size_t{96} << 20) + static_cast<size_t>(ranks) * (size_t{20} << 20);
    EXPECT_GE(bytes, said);
    // the flag pages, block flags and the transfers' flags and table
    EXPECT_LE(bytes, said + (size_t{1} << 20)) << ranks;
  }
}

}  // namespace
}  // namespace loom::detail
