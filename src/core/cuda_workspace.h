#pragma once

// Where the data parts of a rank's CUDA workspace lie (core/cuda_executor.h says what they
// hold): offsets from the workspace's start, after the two lanes' flag pages. Every rank
// computes the same layout from the same chunk, mailbox slot and number of ranks, and maps
// its peers' workspaces with it.

#include <algorithm>
#include <cstddef>

#include "cuda/kernel_params.h"

namespace loom::detail {

/// Where the collective slots start: the flag pages of the eager and the graph lane come
/// first (core/cuda_executor.cc).
inline constexpr size_t kDataOffset = 64 << 10;
/// Slots of two chunks in the eager lane. Stepped calls and the one- and two-shot fused
/// kernels take turns on two; a chained broadcast, whose steps travel the chain one link
/// after another, keeps a step of a chunk in each of the eight halves: with two slots (four
/// steps in flight) it read 0.89-0.93x NCCL's bus bandwidth from 512 MiB on four H200s, with
/// four 0.93-0.97x (docs/PERFORMANCE.md, "A chained broadcast"); a ring all_reduce keeps a
/// hop in each slot.
inline constexpr size_t kEagerSlots = 4;
/// The graph lane's slots of two chunks (stepped calls only).
inline constexpr size_t kGraphSlots = 2;
/// The fused kernels' block flags: arrived, freed, gathered and gather freed, per rank and
/// block (cuda::FusedParams::blockFlags).
inline constexpr size_t kBlockFlagsBytes = 4 * cuda::kMaxSources * cuda::kMaxFusedBlocks * 8;

/// Bytes per mailbox slot for slot halves of `chunk` bytes: a quarter chunk in whole
/// 16-byte vectors, at least 4 KiB.
inline size_t mailSlotBytes(size_t chunk) {
  return std::max<size_t>(chunk / 4 / 16 * 16, 4096);
}

/// Offsets of the data parts, in this order, and the workspace's size.
struct WorkspaceLayout {
  size_t eagerSlots;      ///< kEagerSlots slots of two chunks
  size_t graphSlots;      ///< kGraphSlots slots of two chunks
  size_t eagerMailboxes;  ///< two mailbox slots per sending rank
  size_t graphMailboxes;  ///< the same for captured calls
  size_t blockFlags;      ///< kBlockFlagsBytes
  size_t bytes;           ///< the whole workspace
};

/// The layout for slot halves of `chunk` bytes, mailbox slots of `mailSlot` bytes and
/// `ranks` ranks.
inline WorkspaceLayout workspaceLayout(size_t chunk, size_t mailSlot, int ranks) {
  const size_t mailboxes = static_cast<size_t>(ranks) * 2 * mailSlot;
  WorkspaceLayout l{};
  l.eagerSlots = kDataOffset;
  l.graphSlots = l.eagerSlots + kEagerSlots * 2 * chunk;
  l.eagerMailboxes = l.graphSlots + kGraphSlots * 2 * chunk;
  l.graphMailboxes = l.eagerMailboxes + mailboxes;
  l.blockFlags = l.graphMailboxes + mailboxes;
  l.bytes = l.blockFlags + kBlockFlagsBytes;
  return l;
}

}  // namespace loom::detail
