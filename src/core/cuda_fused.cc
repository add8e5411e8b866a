// The CUDA executor's fused kernels (see cuda_executor.h): a collective as one kernel
// (runFused) and an eager call's transfers as one kernel (fusedTransfer), where every rank
// has a GPU of its own. Their parameters are set here, the kernels are in src/cuda/.

#include <algorithm>

#include "core/cuda_descriptors.h"
#include "core/cuda_executor.h"
#include "core/cuda_steps.h"
#include "cuda/driver.h"
#include "loom/error.h"

namespace loom::detail {

using cuda::check;
using cuda::Driver;

void CudaExecutor::runFused(cuda::FusedParams& p, size_t elementBytes,
                            const CollectiveArgs* reduction) {
  // A slot (both halves) holds a region per peer, so a step is as large as that allows;
  // two-shot keeps the reduce regions in the first half and the gather regions in the
  // second, a share each.
  const size_t peers = static_cast<size_t>(size_ - 1);
  const size_t regionBytes = roundDown((p.twoShot ? 1 : 2) * chunk_ / peers, 16);
  // A two-shot step is one share per owner, a ring's one per rank (each hop carries one); a
  // one-shot step is one region.
  const bool ring = p.chain && p.root < 0;
  // A chain's step and a ring's hop fill a slot of their own, from the one sender: a chained
  // broadcast's a chunk in each half of the eager slots (eight in flight, see kEagerSlots), a
  // ring's a whole slot (four): on four H200s 16 MiB hops read 0.97-1.06x NCCL's bus
  // bandwidth from 64 MiB where 8 MiB ones read 0.88-1.01x and 4 MiB ones 0.74-0.82x, each
  // pass paying about 4.4 us besides its bytes (docs/PERFORMANCE.md, "A ring all_reduce").
  const size_t chainSlot = ring ? 2 * chunk_ : chunk_;
  const size_t shares = p.twoShot ? static_cast<size_t>(cuda::twoShotShares(size_, p.root))
                        : ring    ? static_cast<size_t>(size_)
                                  : 1;
  if (p.twoShot || ring) {
    // Equal shares of whole 16-byte vectors, as large as a region (a ring: a slot) holds.
    const size_t vector = 16 / std::min<size_t>(elementBytes, 16);
    const size_t even = ((p.count + shares - 1) / shares + vector - 1) / vector * vector;
    p.share = std::clamp(even, vector, (ring ? chainSlot : regionBytes) / elementBytes);
    p.perStep = p.share * shares;
    p.gatherAt = p.twoShot ? chunk_ : 0;
  } else if (p.chain) {
    p.perStep = chunk_;  // a copy: counts in bytes
  } else {
    p.perStep = regionBytes / elementBytes;
  }
  p.steps = p.count == 0 ? 1 : (p.count + p.perStep - 1) / p.perStep;
  // A ring's step is ringHops epochs, one per hop.
  const uint64_t epochs = ring ? p.steps * static_cast<uint64_t>(cuda::ringHops(size_)) : p.steps;
  p.firstEpoch = lane_->epoch + 1;
  lane_->epoch += epochs;
  p.lastEpoch = lane_->epoch;
  // Slices of about 64 KiB per block and step (a ring's: hop), up to paths_.fusedBlocks blocks per
  // role; from the call's size alone, so every rank runs as many.
  const uint64_t stepBytes =
      std::min<uint64_t>(p.count * elementBytes / shares, p.chain ? chainSlot : regionBytes);
  const int maxBlocks = p.twoShot ? paths_.twoShotBlocks : paths_.fusedBlocks;
  p.blocks =
      static_cast<int32_t>(std::clamp<uint64_t>((stepBytes + (64 << 10) - 1) >> 16, 1, maxBlocks));
  described_.words[0] |= kFusedBit | uint64_t(p.blocks - 1) << kFusedBlocksShift |
                         (p.twoShot ? kTwoShotBit : 0) | (p.chain ? kChainBit : 0);
  p.rank = rank_;
  p.size = size_;
  p.slotBytes = p.chain ? chainSlot : 2 * chunk_;
  p.regionBytes = p.chain ? 0 : regionBytes;
  p.depth = static_cast<int32_t>(p.chain ? kEagerSlots * 2 * chunk_ / chainSlot : 2);
  for (int q = 0; q < size_; ++q) {
    p.slots[q] = in(q, 0);
    p.blockFlags[q] = reinterpret_cast<uint64_t*>(bases_[q] + layout_.blockFlags);
    p.ready[q] = reinterpret_cast<uint64_t*>(flag(q, kReady, p.firstEpoch));
    p.descriptors[q] = descriptor(q, p.firstEpoch);
  }
  // Tagged with the call's first step as stepped calls are: a peer that issued another
  // collective at this step is the caller's mismatch, whichever path either call took
  // (staleStep).
  p.mine = stepTagged(described_, p.firstEpoch);
  // The kernel writes into every slot of its peers from its first steps, so it waits first
  // until every peer is done with the epochs that used them last, and it says when it is
  // done with its own (FusedParams::toDone): for the calls after it, stepped or fused.
  p.toDone = (kDone - kReady) * static_cast<int64_t>(kFlagStride);
  const int64_t oddMinusEven =
      static_cast<int64_t>(lane_->oddFlagsAt) - static_cast<int64_t>(lane_->flagsAt);
  p.toOtherParity = p.firstEpoch % 2 ? -oddMinusEven : oddMinusEven;
  p.exits = reinterpret_cast<uint64_t*>(bases_[rank_] + kFusedExitsOffset);
  fusedExits_ += cuda::fusedGridBlocks(p);
  p.exitsWhenDone = fusedExits_;
  const cuda::Agreement a = noAgreement();
  p.claim = a.claim;
  p.report = a.report;
  p.abort = a.abort;
  if (trace_) trace_->attach(p, elementBytes);
  if (reduction != nullptr) {
    p.factor = reduction->op.factor();
    p.factorAt = reduction->op.deviceFactor();
    p.divisor = size_;
    kernels_->fusedReduce(stream_, reduction->type, reduction->op.kind(), p);
  } else {
    kernels_->fusedCopy(stream_, p);
  }
}

void CudaExecutor::fusedTransfer(std::span<const Transfer> transfers, uint8_t purpose) {
  if (transfers.size() > static_cast<size_t>(cuda::kMaxTransferMessages)) {
    throw Error(ErrorCode::kInternal, "cuda", rank_, "a fused transfer of too many messages");
  }
  // The table, built in place in a buffer kept across calls: every message (their number is
  // known), then a stream per direction and peer (sends first, then receives, peers in rank
  // order), each naming its messages, in issue order, which is the order of the pair's chunks.
  const size_t messageBytes = transfers.size() * sizeof(cuda::TransferMessage);
  const size_t mostBytes =
      messageBytes + 2 * static_cast<size_t>(size_) * sizeof(cuda::TransferStream);
  transferTable_.resize((mostBytes + 7) / 8);  // 64-bit words: aligned for both structs
  auto* messages = reinterpret_cast<cuda::TransferMessage*>(transferTable_.data());
  auto* streams = reinterpret_cast<cuda::TransferStream*>(
      reinterpret_cast<uint8_t*>(transferTable_.data()) + messageBytes);
  int32_t nmessages = 0;
  int32_t nstreams = 0;
  for (const Transfer::Kind kind : {Transfer::Kind::kSend, Transfer::Kind::kRecv}) {
    const bool sends = kind == Transfer::Kind::kSend;
    for (int q = 0; q < size_; ++q) {
      uint64_t& count = (sends ? lane_->sent : lane_->taken)[static_cast<size_t>(q)];
      cuda::TransferStream st{q, sends ? 1 : 0, nmessages, 0, count};
      for (const Transfer& t : transfers) {
        if (t.kind != kind || t.peer != q) continue;
        // Marked fused: a peer on the stepped path signals otherwise and must get the named
        // mismatch, not a wait that never ends.
        const uint64_t word0 = describeChunk(t, purpose, 0, 0).words[0] | kFusedBit;
        messages[nmessages++] = {static_cast<uint8_t*>(t.data), t.bytes, word0};
        count += std::max<uint64_t>(1, (t.bytes + lane_->mailSlot - 1) / lane_->mailSlot);
        ++st.count;
      }
      if (st.count > 0) streams[nstreams++] = st;
    }
  }
  if (nstreams == 0) return;
  // Written on the stream before the launch, so it replaces the table of the lane's last
  // call only after that call's kernel (which queue() orders first) is done with it. The
  // driver stages a pageable source before it returns.
  uint8_t* table = bases_[rank_] + layout_.transferTable;
  check(Driver::get().cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(table), transferTable_.data(),
                                        messageBytes + nstreams * sizeof(cuda::TransferStream),
                                        stream_),
        "cuda", rank_, "cuMemcpyHtoDAsync");
  // The grid's blocks per stream: as many as the fused kernels' two roles of paths_.fusedBlocks
  // allow (what fusedFits() vouches for), a power of two so that each moves as many pieces.
  // The peers need not agree (the flags count per piece): a ring's two streams get 64 each,
  // all of four ranks' six streams 16; on four H200s send_recv's bus bandwidth at 512 MiB-1 GiB
  // read 0.85-0.90x NCCL's with 21 blocks per stream, 0.93x with 42, 1.00x with 64
  // (docs/PERFORMANCE.md, "Sends and receives").
  int blocks = transferMostBlocks_;
  while (blocks > 1 && nstreams * blocks > 2 * paths_.fusedBlocks) blocks /= 2;
  cuda::TransferParams p{};
  p.messages = reinterpret_cast<const cuda::TransferMessage*>(table);
  p.streams = reinterpret_cast<const cuda::TransferStream*>(table + messageBytes);
  p.nstreams = nstreams;
  p.blocks = blocks;
  p.rank = rank_;
  p.mailSlot = lane_->mailSlot;
  for (int q = 0; q < size_; ++q) {
    uint8_t* flags = bases_[q] + layout_.transferFlags;
    p.mailboxes[q] = bases_[q] + lane_->mailboxesAt;
    p.sentFlags[q] = reinterpret_cast<uint64_t*>(flags);
    p.takenFlags[q] = reinterpret_cast<uint64_t*>(flags + kTransferSentBytes);
    p.chunkDescriptors[q] = reinterpret_cast<cuda::Descriptor*>(flags + 2 * kTransferSentBytes);
  }
  const cuda::Agreement a = noAgreement();
  p.claim = a.claim;
  p.report = a.report;
  p.abort = a.abort;
  kernels_->fusedTransfer(stream_, p);
}

}  // namespace loom::detail
