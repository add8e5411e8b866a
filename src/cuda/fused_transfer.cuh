#pragma once

// The fused transfer (TransferParams in kernel_params.h says what it does): a call's sends
// and receives in one cooperative launch, for ranks that each have a GPU of their own.
// Included by kernels.cu after fused_collective.cuh, whose flag and copy helpers it uses.

#include "cuda/fused_collective.cuh"
#include "cuda/kernel_params.h"

namespace loom::cuda::device {

// In `receiver`'s workspace: how many chunks `sender` has put piece `piece` of in its
// mailbox.
__device__ inline uint64_t* sentFlag(const TransferParams& p, int receiver, int sender, int piece) {
  return p.sentFlags[receiver] + sender * kTransferPieces + piece;
}
// In `sender`'s workspace: how many chunks `receiver` has taken piece `piece` of out of its
// mailbox for `sender`.
__device__ inline uint64_t* takenFlag(const TransferParams& p, int sender, int receiver,
                                      int piece) {
  return p.takenFlags[sender] + receiver * kTransferPieces + piece;
}
// In `receiver`'s workspace: the descriptor `sender` wrote with piece `piece` of chunk
// number `chunk`. A copy per piece: the sender overwrites it two chunks later once the
// receiver is done with that piece, whatever happens to the other pieces.
__device__ inline Descriptor* chunkDescriptor(const TransferParams& p, int receiver, int sender,
                                              uint64_t chunk, int piece) {
  return p.chunkDescriptors[receiver] +
         (static_cast<uint64_t>(sender) * 2 + chunk % 2) * kTransferPieces + piece;
}
// Where `sender`'s chunk number `chunk` lies in `receiver`'s mailbox.
__device__ inline uint8_t* mailboxSlot(const TransferParams& p, int receiver, int sender,
                                       uint64_t chunk) {
  return p.mailboxes[receiver] + (static_cast<uint64_t>(sender) * 2 + chunk % 2) * p.mailSlot;
}

// A sending block's pieces of chunk `chunk` (of `src`, bytes into its message) to peer q,
// with the chunk's descriptor `d`; thread k speaks for piece s.first + k's flags (here and in
// receivePieces). False if the communicator failed first.
__device__ inline bool sendPieces(const TransferParams& p, int q, uint64_t chunk,
                                  const uint8_t* src, const TransferPieces& s, Descriptor d) {
  const int k = static_cast<int>(threadIdx.x);
  bool ok = true;
  if (k < s.count && chunk > 2) {
    ok = awaitFlag(takenFlag(p, p.rank, q, s.first + k), chunk - 2, p.abort);
  }
  if (!__syncthreads_and(ok)) return false;
  copyByBlock(mailboxSlot(p, q, p.rank, chunk) + s.from, src + s.from, s.to - s.from);
  if (k < s.count) *chunkDescriptor(p, q, p.rank, chunk, s.first + k) = d;
  // Every thread's writes reach the system before the flags (see raise).
  __syncthreads();
  if (k < s.count) raise(sentFlag(p, q, p.rank, s.first + k), chunk);
  return true;
}

// A receiving block's pieces of chunk `chunk` from peer q into `dst` (bytes into its
// message), once the sender has sent each of them with a descriptor that matches `d`.
// False if the communicator failed or the peer sent something else (reported here).
__device__ inline bool receivePieces(const TransferParams& p, int q, uint64_t chunk, uint8_t* dst,
                                     const TransferPieces& s, Descriptor d) {
  const int k = static_cast<int>(threadIdx.x);
  bool ok = true;
  if (k < s.count) {
    ok = awaitFlag(sentFlag(p, p.rank, q, s.first + k), chunk, p.abort);
    const volatile Descriptor* theirs = chunkDescriptor(p, p.rank, q, chunk, s.first + k);
    const Descriptor got = readDescriptor(theirs);
    if (ok && !sameDescriptor(got, d)) {
      reportMismatch(p.claim, p.report, p.abort, q, d, got);  // the first claim wins
      ok = false;
    }
  }
  if (!__syncthreads_and(ok)) return false;
  copyByBlock(dst + s.from, mailboxSlot(p, p.rank, q, chunk) + s.from, s.to - s.from);
  __syncthreads();  // every thread's loads are done (their values are stored)
  if (k < s.count) raise(takenFlag(p, q, p.rank, s.first + k), chunk);
  return true;
}

// One block of one stream: its pieces of every chunk of the stream's messages, in order.
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
      const TransferPieces s = transferPieces(p.mailSlot, p.blocks, block, n);
      // As core/cuda_descriptors.cc's describeChunk writes it, the pair's chunk number last.
      const Descriptor d{{msg.word0, (msg.bytes & ((uint64_t{1} << 40) - 1)) | c << 40, chunk}};
      const bool ok = st.sends ? sendPieces(p, st.peer, chunk, msg.data + lo, s, d)
                               : receivePieces(p, st.peer, chunk, msg.data + lo, s, d);
      if (!ok) return;
    }
  }
}

}  // namespace loom::cuda::device
