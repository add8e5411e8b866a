// The CUDA workspace's data layout (core/cuda_workspace.h): its parts follow each other
// without overlap for every chunk and rank count, and the chained broadcast's steps fit
// in the eager lane's slots. Plain C++: the executor that uses it needs a GPU.

#include "core/cuda_workspace.h"

#include <gtest/gtest.h>

namespace loom::detail {
namespace {

TEST(WorkspaceLayout, PartsFollowEachOtherWithoutOverlap) {
  for (size_t chunk : {size_t{64} << 10, size_t{1} << 20, size_t{8} << 20, size_t{1} << 30}) {
    const size_t mail = mailSlotBytes(chunk);
    for (int ranks = 1; ranks <= cuda::kMaxSources; ++ranks) {
      const WorkspaceLayout l = workspaceLayout(chunk, mail, ranks);
      const size_t mailboxes = static_cast<size_t>(ranks) * 2 * mail;
      EXPECT_GE(l.eagerSlots, kDataOffset);
      EXPECT_GE(l.graphSlots, l.eagerSlots + kEagerSlots * 2 * chunk) << chunk << " " << ranks;
      EXPECT_GE(l.eagerMailboxes, l.graphSlots + kGraphSlots * 2 * chunk);
      EXPECT_GE(l.graphMailboxes, l.eagerMailboxes + mailboxes);
      EXPECT_GE(l.blockFlags, l.graphMailboxes + mailboxes);
      EXPECT_EQ(l.bytes, l.blockFlags + kBlockFlagsBytes);
      EXPECT_EQ(l.blockFlags % 8, 0u);  // 64-bit flags
    }
  }
}

// A chained broadcast keeps a step of a chunk in each half of the eager slots, and the
// stepped path's two slots are the first of them.
TEST(WorkspaceLayout, EagerSlotsHoldTheChainsStepsAndTheSteppedPathsTwo) {
  const size_t chunk = size_t{8} << 20;
  const WorkspaceLayout l = workspaceLayout(chunk, mailSlotBytes(chunk), 4);
  EXPECT_GE(kEagerSlots, 2u);
  EXPECT_EQ(l.graphSlots - l.eagerSlots, 2 * kEagerSlots * chunk);
}

// docs/CONFIGURATION.md (LOOM_CUDA_CHUNK_BYTES): about 96 MiB + 8 MiB per rank by default.
TEST(WorkspaceLayout, DefaultSizeIsWhatTheDocsSay) {
  const size_t chunk = size_t{8} << 20;
  for (int ranks : {2, 4, 8}) {
    const size_t bytes = workspaceLayout(chunk, mailSlotBytes(chunk), ranks).bytes;
    const size_t said = (size_t{96} << 20) + static_cast<size_t>(ranks) * (size_t{8} << 20);
    EXPECT_GE(bytes, said);
    EXPECT_LE(bytes, said + (size_t{1} << 20)) << ranks;  // the flag pages and block flags
  }
}

}  // namespace
}  // namespace loom::detail
