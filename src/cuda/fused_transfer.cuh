#pragma once

// The fused transfer (TransferParams in kernel_params.h says what it does): a call's sends
// and receives in one cooperative launch, for ranks that each have a GPU of their own.
// Included by kernels.cu after fused_collective.cuh, whose flag and copy helpers it uses.

#include "cuda/fused_collective.cuh"
#include "cuda/kernel_params.h"

namespace loom::cuda::device {

// In `receiver`'s workspace: how many chunks `sender`'s block `block` has put in its mailbox.
__device__ inline uint64_t* sentFlag(const TransferParams& p, int receiver, int sender, int block) {
  return p.sentFlags[receiver] + sender * kMaxTransferBlocks + block;
}
// In `sender`'s workspace: how many chunks `receiver`'s block `block` has taken out of its
// mailbox for `sender`.
__device__ inline uint64_t* takenFlag(const TransferParams& p, int sender, int receiver,
                                      int block) {
  return p.takenFlags[sender] + receiver * kMaxTransferBlocks + block;
}
// In `receiver`'s workspace: the descriptor `sender`'s block `block` wrote with chunk
// number `chunk`. A copy per block: a sender's block overwrites it two chunks later once
// the receiver's same block is done with it, whatever the other blocks are doing.
__device__ inline Descriptor* chunkDescriptor(const TransferParams& p, int receiver, int sender,
                                              uint64_t chunk, int block) {
  return p.chunkDescriptors[receiver] +
         (static_cast<uint64_t>(sender) * 2 + chunk % 2) * kMaxTransferBlocks + block;
}
// Where `sender`'s chunk number `chunk` lies in `receiver`'s mailbox.
__device__ inline uint8_t* mailboxSlot(const TransferParams& p, int receiver, int sender,
                                       uint64_t chunk) {
  return p.mailboxes[receiver] + (static_cast<uint64_t>(sender) * 2 + chunk % 2) * p.mailSlot;
}

// A sending block's slice [from, to) of chunk `chunk` (of `src`, bytes into its message) to
// peer q, with the chunk's descriptor `d`. False if the communicator failed first.
__device__ inline bool sendSlice(const TransferParams& p, int q, int block, uint64_t chunk,
                                 const uint8_t* src, FusedSlice s, Descriptor d) {
  bool ok = true;
  if (threadIdx.x == 0 && chunk > 2) {
    ok = awaitFlag(takenFlag(p, p.rank, q, block), chunk - 2, p.abort);
  }
  if (!__syncthreads_and(ok)) return false;
  copyByBlock(mailboxSlot(p, q, p.rank, chunk) + s.from, src + s.from, s.to - s.from);
  if (threadIdx.x == 0) *chunkDescriptor(p, q, p.rank, chunk, block) = d;
  // Every thread's writes reach the system before the flag (see raise).
  __syncthreads();
  if (threadIdx.x == 0) raise(sentFlag(p, q, p.rank, block), chunk);
  return true;
}

// A receiving block's slice [from, to) of chunk `chunk` from peer q into `dst` (bytes into
// its message), once the sender's same block has sent it and its descriptor matches `d`.
// False if the communicator failed or the peer sent something else (reported here).
__device__ inline bool receiveSlice(const TransferParams& p, int q, int block, uint64_t chunk,
                                    uint8_t* dst, FusedSlice s, Descriptor d) {
  bool ok = true;
  if (threadIdx.x == 0) {
    ok = awaitFlag(sentFlag(p, p.rank, q, block), chunk, p.abort);
    const volatile Descriptor* theirs = chunkDescriptor(p, p.rank, q, chunk, block);
    const Descriptor got{{theirs->words[0], theirs->words[1]}};
    if (ok && (got.words[0] != d.words[0] || got.words[1] != d.words[1])) {
      reportMismatch(p.claim, p.report, p.abort, q, d, got);
      ok = false;
    }
  }
  if (!__syncthreads_and(ok)) return false;
  copyByBlock(dst + s.from, mailboxSlot(p, p.rank, q, chunk) + s.from, s.to - s.from);
  __syncthreads();  // every thread's loads are done (their values are stored)
  if (threadIdx.x == 0) raise(takenFlag(p, q, p.rank, block), chunk);
  return true;
}

// One block of one stream: its slice of every chunk of the stream's messages, in order.
__device__ inline void fusedTransfer(const TransferParams& p) {
  const int index = static_cast<int>(blockIdx.x);
  const TransferStream st = p.streams[index % p.nstreams];
  const int block = index / p.nstreams;
  uint64_t chunk = st.chunksBefore;
  for (int m = st.first; m < st.first + st.count; ++m) {
    const TransferMessage msg = p.messages[m];
    const uint64_t chunks = msg.bytes == 0 ? 1 : (msg.bytes + p.mailSlot - 1) / p.mailSlot;
    for (uint64_t c = 0; c < chunks; ++c) {
      ++chunk;
      const uint64_t lo = c * p.mailSlot;
      const uint64_t n = msg.bytes - lo < p.mailSlot ? msg.bytes - lo : p.mailSlot;
      // Slices of whole 16-byte vectors, in the same place of every chunk (fusedSlice).
      const FusedSlice s = fusedSlice(p.mailSlot, n, p.blocks, block, 16);
      const Descriptor d{{msg.word0, (msg.bytes & ((uint64_t{1} << 40) - 1)) | c << 40}};
      const bool ok = st.sends ? sendSlice(p, st.peer, block, chunk, msg.data + lo, s, d)
                               : receiveSlice(p, st.peer, block, chunk, msg.data + lo, s, d);
      if (!ok) return;
    }
  }
}

}  // namespace loom::cuda::device
