#pragma once

// Where the parts of a rank's CUDA workspace lie (core/cuda_executor.h says what they
// hold): the two lanes' flag pages at fixed offsets, then the data parts, whose offsets every
// rank computes alike from the same chunk, mailbox slot and number of ranks, and maps its
// peers' workspaces with.

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/kernel_params.h"

namespace loom::detail {

/// Every flag and descriptor of a flags page sits on a line of its own.
inline constexpr size_t kFlagStride = 64;

// The flags pages. The eager lane's collective flags of even epochs (one 64-byte line
// each), the abort word, the mismatch claim, the eager lane's descriptors (by epoch parity),
// the count of fused kernel blocks finished, its collective flags of odd epochs, then per
// peer a pair block: the "sent" flag (chunks sent to it), the "taken" flag (chunks taken
// from it) and the descriptors of the chunks sent to it (by chunk parity). At 32 KiB the
// graph lane's: its collective flags of even epochs, device epoch, descriptors and flags of
// odd epochs, its device counts of chunks sent to and taken from each peer, and its pair
// blocks; after them the counts a rank leaves as it destroys its communicator (a word that
// says they are written, then per peer the eager lane's chunks sent to it and taken from it,
// which a peer's monitor compares with its own), and the graph lane's record of the flag wait
// in progress. Then, from kDataOffset, the data parts (WorkspaceLayout).
inline constexpr size_t kAbortOffset = 3 * kFlagStride;
inline constexpr size_t kClaimOffset = 4 * kFlagStride;
inline constexpr size_t kDescOffset = 5 * kFlagStride;
inline constexpr size_t kFusedExitsOffset = 6 * kFlagStride;  // FusedParams::exits
inline constexpr size_t kOddFlagsOffset = 8 * kFlagStride;
inline constexpr size_t kPairOffset = 16 * kFlagStride;
inline constexpr size_t kPairStride = 4 * kFlagStride;
inline constexpr size_t kPairDescOffset = 2 * kFlagStride;
inline constexpr size_t kGraphOffset = 32 << 10;
inline constexpr size_t kDeviceEpochOffset = kGraphOffset + 3 * kFlagStride;
inline constexpr size_t kGraphDescOffset = kGraphOffset + 4 * kFlagStride;
inline constexpr size_t kGraphOddFlagsOffset = kGraphOffset + 5 * kFlagStride;
inline constexpr size_t kGraphCountsOffset =
    kGraphOffset + 8 * kFlagStride;  // sent, taken per peer
inline constexpr size_t kGraphPairOffset = kGraphOffset + (2 << 10);
static_assert(kDescOffset + 2 * sizeof(cuda::Descriptor) <= kFusedExitsOffset &&
              kFusedExitsOffset + sizeof(uint64_t) <= kOddFlagsOffset &&
              kOddFlagsOffset + 3 * kFlagStride <= kPairOffset);
static_assert(kGraphOddFlagsOffset + 3 * kFlagStride <= kGraphCountsOffset);
static_assert(kPairOffset + cuda::kMaxSources * kPairStride <= kGraphOffset);
static_assert(kGraphCountsOffset + cuda::kMaxSources * 16 <= kGraphPairOffset);

inline constexpr size_t kFinalCountsOffset = kGraphPairOffset + cuda::kMaxSources * kPairStride;
/// The graph lane's record of the flag wait in progress (cuda::FlagParams::waiting).
inline constexpr size_t kGraphWaitOffset = kFinalCountsOffset + 9 * kFlagStride;
static_assert(kFinalCountsOffset + (1 + 2 * cuda::kMaxSources) * sizeof(uint64_t) <=
              kGraphWaitOffset);

/// Where the collective slots start, after both lanes' flag pages.
inline constexpr size_t kDataOffset = 64 << 10;
static_assert(kGraphWaitOffset + 2 * sizeof(uint64_t) <= kDataOffset);
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
/// The fused transfers' flags and descriptors (cuda::TransferParams): sent[sender][piece],
/// taken[receiver][piece], then a descriptor per sender, chunk parity and piece.
inline constexpr size_t kTransferSentBytes = cuda::kMaxSources * cuda::kTransferPieces * 8;
inline constexpr size_t kTransferFlagsBytes = 2 * kTransferSentBytes + cuda::kMaxSources * 2 *
                                                                           cuda::kTransferPieces *
                                                                           sizeof(cuda::Descriptor);
/// A fused transfer call's table (its messages, then its streams), written before each
/// launch; only this rank reads its own.
inline constexpr size_t kTransferTableBytes =
    2 * cuda::kMaxSources * sizeof(cuda::TransferStream) +
    cuda::kMaxTransferMessages * sizeof(cuda::TransferMessage);

/// Bytes per mailbox slot of the eager lane for slot halves of `chunk` bytes: a whole chunk.
/// A pair's two slots are what a fused transfer keeps in flight between two GPUs: on two
/// H200s send/recv of 512 MiB-1 GiB read 0.76-0.77x NCCL's bandwidth through slots of 2 MiB
/// and 1.00-1.03x through slots of 8 MiB, 64 blocks per pair both (docs/PERFORMANCE.md,
/// "Sends and receives").
inline size_t eagerMailSlotBytes(size_t chunk) {
  return chunk;
}
/// Bytes per mailbox slot of the graph lane (stepped calls only): a quarter chunk in whole
/// 16-byte vectors, at least 4 KiB.
inline size_t graphMailSlotBytes(size_t chunk) {
  return std::max<size_t>(chunk / 4 / 16 * 16, 4096);
}

/// Offsets of the data parts, in this order, and the workspace's size.
struct WorkspaceLayout {
  size_t eagerSlots;      ///< kEagerSlots slots of two chunks
  size_t graphSlots;      ///< kGraphSlots slots of two chunks
  size_t eagerMailSlot;   ///< eagerMailSlotBytes
  size_t graphMailSlot;   ///< graphMailSlotBytes
  size_t eagerMailboxes;  ///< two mailbox slots per sending rank
  size_t graphMailboxes;  ///< the same for captured calls
  size_t blockFlags;      ///< kBlockFlagsBytes
  size_t transferFlags;   ///< kTransferFlagsBytes
  size_t transferTable;   ///< kTransferTableBytes
  size_t bytes;           ///< the whole workspace
};

/// The layout for slot halves of `chunk` bytes and `ranks` ranks.
inline WorkspaceLayout workspaceLayout(size_t chunk, int ranks) {
  WorkspaceLayout l{};
  l.eagerMailSlot = eagerMailSlotBytes(chunk);
  l.graphMailSlot = graphMailSlotBytes(chunk);
  l.eagerSlots = kDataOffset;
  l.graphSlots = l.eagerSlots + kEagerSlots * 2 * chunk;
  l.eagerMailboxes = l.graphSlots + kGraphSlots * 2 * chunk;
  l.graphMailboxes = l.eagerMailboxes + static_cast<size_t>(ranks) * 2 * l.eagerMailSlot;
  l.blockFlags = l.graphMailboxes + static_cast<size_t>(ranks) * 2 * l.graphMailSlot;
  l.transferFlags = l.blockFlags + kBlockFlagsBytes;
  l.transferTable = l.transferFlags + kTransferFlagsBytes;
  l.bytes = l.transferTable + kTransferTableBytes;
  return l;
}

}  // namespace loom::detail
