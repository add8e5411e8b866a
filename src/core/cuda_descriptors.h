#pragma once

// What a CUDA call's descriptor says (cuda::Descriptor): the words every rank publishes for
// a collective, or for each chunk of a transfer, so that peers compare them before they move
// a byte, and how a differing pair reads in the mismatch error. Internal to the CUDA executor.

#include <cstdint>
#include <string>

#include "core/device_executor.h"
#include "cuda/kernel_params.h"

namespace loom::detail {

// Descriptors (cuda::Descriptor). Word 0: what (8 bits: a CollectiveKind, or a transfer's
// purpose below) | dtype (8) | reduce kind (8) | 1 if per-rank sizes vary (8) | root or
// tag (32). Word 1: the element count, or the hash of the per-rank counts (48 bits each,
// below a step tag: kStepTagShift); for a transfer, its bytes (40 bits) and the chunk's
// index (24). Word 2: a PREMUL_SUM's factor (the double's bits; the kernels write those of a
// factor in device memory); for a transfer, the chunk's number in its pair's stream (a
// captured call's counted from its start, the kernels adding the device count); else 0.
inline constexpr int kChunkShift = 40;
// In word 0: the call runs as one fused kernel, and for a collective with how many block
// pairs less one (6 bits): ranks that disagree on either get the named mismatch, not a hang.
// (A fused transfer's two ends need not run as many blocks: cuda::TransferParams.)
inline constexpr uint64_t kFusedBit = uint64_t{1} << 25;
inline constexpr int kFusedBlocksShift = 26;
// A call fused in two shots (all_reduce, broadcast): the top bit of the high half, which
// holds a root (below 2^31) or nothing for them; only send/recv tags use all 32 bits.
inline constexpr uint64_t kTwoShotBit = uint64_t{1} << 63;
// A broadcast fused along a chain, or an all_reduce around a ring: the bit below it (a root,
// a rank of one host, stays far below 2^30).
inline constexpr uint64_t kChainBit = uint64_t{1} << 62;

// In word 1 of a collective's descriptor as a call publishes it (stepped or fused): the low
// 16 bits of its first step (stepTagged). A rank whose kernels stopped (its communicator failed)
// still raises its flags but publishes nothing, so its peers would read the descriptor it left two
// steps before, of a call that may have been the same: the tag tells the two apart. A captured
// call's steps count from the call's start, and its kernels add the device epoch that its
// replay starts from (cuda::replayTagged), so a replay tells its steps from an earlier replay's
// too. Counts and hashes keep the 48 bits below it.
using cuda::kStepTagShift;
inline constexpr uint64_t kCountMask = (uint64_t{1} << kStepTagShift) - 1;

/// A transfer's purpose, in its descriptors (beside the CollectiveKinds of collectives).
inline constexpr uint8_t kSendRecv = 0x40;
inline constexpr uint8_t kAllToAllBlock = 0x41;

/// The descriptor of collective `args` (its first step; fused calls add their bits).
cuda::Descriptor describe(const CollectiveArgs& args);
/// The descriptor of chunk number `chunk` of transfer `t`, made for `purpose`, which is
/// number `sequence` of the pair's chunks in its direction (what tells it from an identical
/// chunk of an earlier message left in the same mailbox slot).
cuda::Descriptor describeChunk(const Transfer& t, uint8_t purpose, uint64_t chunk,
                               uint64_t sequence);
/// `d` (a collective's) tagged with step `step`.
cuda::Descriptor stepTagged(cuda::Descriptor d, uint64_t step);
/// Whether `theirs` (a peer's descriptor where `mine` expects it) was left from an earlier
/// step or chunk: a collective's with another step's tag, a transfer's with another chunk
/// number. The peer published nothing for this one (its kernels stopped), which is no
/// mismatch of the caller's making, whatever that earlier call was.
bool staleStep(const cuda::Descriptor& mine, const cuda::Descriptor& theirs);
/// A descriptor in words, for the mismatch error.
std::string explain(const cuda::Descriptor& d);
/// The mismatch error where rank `peer` issued collective `theirs` and rank `self` `mine`
/// (neither a transfer's): both calls, then what to do (for one call that the ranks ran with
/// different kernels, not what the user issued). Short enough for the failure record that
/// carries it to every rank.
std::string collectiveMismatch(int peer, int self, const cuda::Descriptor& theirs,
                               const cuda::Descriptor& mine);

}  // namespace loom::detail
