// loom's CUDA kernels: the stepped and the fused reduction (every dtype x ReduceOp, one
// kernel each, named loom_reduce_<DataType>_<ReduceKind> and loom_fused_<DataType>_<ReduceKind>
// by enum value), the fused copy, the fused transfer, and copies. 128-bit loads and stores
// where every pointer is 16-byte aligned, element by element elsewhere.
// Sources are combined in rank order with one rounding per element, and the build turns
// off FMA contraction, so results are bit-identical across ranks and equal to the CPU
// kernels' (src/kernels/reduce_impl.h has the same semantics). Before its work every
// kernel checks that its peers run the same step (Agreement): ranks that issued different
// operations get a named error instead of a wrong answer.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <cuda/atomic>

#include <type_traits>

#include "cuda/fused_collective.cuh"
#include "cuda/fused_transfer.cuh"
#include "cuda/kernel_common.cuh"
#include "cuda/kernel_params.h"

using loom::cuda::Agreement;
using loom::cuda::CopyParams;
using loom::cuda::Descriptor;
using loom::cuda::FlagParams;
using loom::cuda::FusedParams;
using loom::cuda::ReduceParams;
using loom::cuda::SpreadParams;
using loom::cuda::TransferParams;

using namespace loom::cuda::device;

namespace {

// Checks the peers and publishes this rank (see Agreement). False: do no work, because
// the communicator failed or a peer is doing something else (reported here).
__device__ bool agree(const Agreement& a) {
  if (*a.abort != 0) return false;
  const uint64_t replayStart = a.replayEpoch != nullptr ? *a.replayEpoch : 0;
  for (int i = 0; i < a.nexpect; ++i) {
    const Agreement::Expect& x = a.expect[i];
    const Descriptor mine = withFactor(
        replayTagged(sequenced(x.words, a.pairCounts, x.peer, true), replayStart), a.factorAt);
    const Descriptor theirs = readDescriptor(x.theirs);
    if (sameDescriptor(mine, theirs)) continue;
    // Every block finds the same; one thread of all of them writes the report.
    if (threadIdx.x == 0) reportMismatch(a.claim, a.report, a.abort, x.peer, mine, theirs);
    return false;
  }
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < a.npublish) {
    const Agreement::Publish& x = a.publish[threadIdx.x];
    *x.at = withFactor(replayTagged(sequenced(x.words, a.pairCounts, x.peer, false), replayStart),
                       a.factorAt);
  }
  return true;
}

// Element i of the reduction.
template <class S, class A, int K>
__device__ inline S reduceOne(const ReduceParams& p, uint64_t i) {
  const S* const* srcs = reinterpret_cast<const S* const*>(p.srcs);
  A factor{};
  if constexpr (K == kPremulSum) factor = static_cast<A>(factorOf(p.factor, p.factorAt));
  A acc = widen<A>(srcs[0][i]);
  if constexpr (K == kPremulSum) acc = acc * factor;
  for (int s = 1; s < p.nsrc; ++s) {
    const A v = widen<A>(srcs[s][i]);
    if constexpr (K == kPremulSum)
      acc = acc + v * factor;
    else
      acc = combine<K>(acc, v);
  }
  if constexpr (K == kAvg) acc = acc / static_cast<A>(p.divisor);
  return narrow<S>(acc);
}

template <class S, class A, int K>
__device__ void reduceBody(const ReduceParams& p) {
  if (!agree(p.agreement)) return;
  constexpr int kV = 16 / sizeof(S);
  bool aligned = reinterpret_cast<uintptr_t>(p.dst) % 16 == 0;
  for (int s = 0; s < p.nsrc; ++s) aligned &= reinterpret_cast<uintptr_t>(p.srcs[s]) % 16 == 0;
  const uint64_t vectors = aligned ? p.count / kV : 0;
  const uint64_t first = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  A factor{};
  if constexpr (K == kPremulSum) factor = static_cast<A>(factorOf(p.factor, p.factorAt));
  for (uint64_t v = first; v < vectors; v += stride) {
    union Pack {
      uint4 raw;
      S e[kV];
    };
    Pack in;
    A acc[kV];
    in.raw = reinterpret_cast<const uint4*>(p.srcs[0])[v];
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      acc[j] = widen<A>(in.e[j]);
      if constexpr (K == kPremulSum) acc[j] = acc[j] * factor;
    }
    for (int s = 1; s < p.nsrc; ++s) {
      in.raw = reinterpret_cast<const uint4*>(p.srcs[s])[v];
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        const A x = widen<A>(in.e[j]);
        if constexpr (K == kPremulSum)
          acc[j] = acc[j] + x * factor;
        else
          acc[j] = combine<K>(acc[j], x);
      }
    }
    Pack out;
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      if constexpr (K == kAvg) acc[j] = acc[j] / static_cast<A>(p.divisor);
      out.e[j] = narrow<S>(acc[j]);
    }
    reinterpret_cast<uint4*>(p.dst)[v] = out.raw;
  }
  S* dst = static_cast<S*>(p.dst);
  for (uint64_t i = vectors * kV + first; i < p.count; i += stride)
    dst[i] = reduceOne<S, A, K>(p, i);
}

}  // namespace

// The stepped and the fused reduction (fused_collective.cuh) of one type and op.
#define LOOM_REDUCE(T, kind, S, A)                                                           \
  static_assert(loom::cuda::ringReduces(T, kind) == std::is_same_v<S, A>,                    \
                "the host's ring rule (ringReduces) disagrees with the accumulator");        \
  extern "C" __global__ void loom_reduce_##T##_##kind(ReduceParams p) {                      \
    reduceBody<S, A, kind>(p);                                                               \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(512) loom_fused_##T##_##kind(FusedParams p) { \
    fusedCollective<S, A, kind, true>(p);                                                    \
  }

// Floating point: every kind but the bitwise ones (DataType 0-3).
#define LOOM_FLOAT_KINDS(T, S)                \
  LOOM_REDUCE(T, 0, S, typename Acc<S>::type) \
  LOOM_REDUCE(T, 1, S, typename Acc<S>::type) \
  LOOM_REDUCE(T, 2, S, typename Acc<S>::type) \
  LOOM_REDUCE(T, 3, S, typename Acc<S>::type) \
  LOOM_REDUCE(T, 4, S, typename Acc<S>::type) \
  LOOM_REDUCE(T, 5, S, typename Acc<S>::type)
// Integers: every kind but PREMUL_SUM; AVG sums in int64 before the (truncating) division.
#define LOOM_INT_KINDS(T, S)    \
  LOOM_REDUCE(T, 0, S, S)       \
  LOOM_REDUCE(T, 1, S, S)       \
  LOOM_REDUCE(T, 2, S, S)       \
  LOOM_REDUCE(T, 3, S, S)       \
  LOOM_REDUCE(T, 4, S, int64_t) \
  LOOM_REDUCE(T, 6, S, S)       \
  LOOM_REDUCE(T, 7, S, S)       \
  LOOM_REDUCE(T, 8, S, S)

LOOM_FLOAT_KINDS(0, float)
LOOM_FLOAT_KINDS(1, double)
LOOM_FLOAT_KINDS(2, __half)
LOOM_FLOAT_KINDS(3, __nv_bfloat16)
LOOM_INT_KINDS(4, int8_t)
LOOM_INT_KINDS(5, uint8_t)
LOOM_INT_KINDS(6, int16_t)
LOOM_INT_KINDS(7, int32_t)
LOOM_INT_KINDS(8, int64_t)
// Bool (9) as bytes: SUM, MAX and BOR are logical or, PRODUCT, MIN and BAND logical and.
LOOM_REDUCE(9, 6, uint8_t, uint8_t)
LOOM_REDUCE(9, 7, uint8_t, uint8_t)
LOOM_REDUCE(9, 8, uint8_t, uint8_t)

// The fused collectives that only move bytes (all_gather, broadcast, all_to_all).
extern "C" __global__ void __launch_bounds__(512) loom_fused_copy(FusedParams p) {
  fusedCollective<uint8_t, uint8_t, kSum, false>(p);
}

// A call's sends and receives (TransferParams): every direction of every pair at once.
extern "C" __global__ void __launch_bounds__(512) loom_fused_transfer(TransferParams p) {
  fusedTransfer(p);
}

// Copies segment blockIdx.y of p, 16 bytes at a time where both ends are aligned.
extern "C" __global__ void loom_copy(CopyParams p) {
  if (!agree(p.agreement) || blockIdx.y >= p.count) return;
  const loom::cuda::Segment seg = p.segments[blockIdx.y];
  const uint64_t first = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  uint64_t done = 0;
  if ((reinterpret_cast<uintptr_t>(seg.dst) | reinterpret_cast<uintptr_t>(seg.src)) % 16 == 0) {
    const uint64_t vectors = seg.bytes / 16;
    const uint4* src = static_cast<const uint4*>(seg.src);
    uint4* dst = static_cast<uint4*>(seg.dst);
    for (uint64_t v = first; v < vectors; v += stride) dst[v] = src[v];
    done = vectors * 16;
  }
  const uint8_t* src = static_cast<const uint8_t*>(seg.src);
  uint8_t* dst = static_cast<uint8_t*>(seg.dst);
  for (uint64_t i = done + first; i < seg.bytes; i += stride) dst[i] = src[i];
}

// Copies this block's run of the pieces laid end to end (see SpreadParams): four 16-byte
// vectors in flight per thread where the piece is aligned, bytes elsewhere.
extern "C" __global__ void loom_copy_spread(SpreadParams p) {
  const uint64_t begin = blockIdx.x * p.perBlock;
  const uint64_t end = begin + p.perBlock;
  const unsigned step = blockDim.x;
  for (int i = loom::cuda::firstSpreadPiece(p, begin); i < p.count && p.starts[i] < end; ++i) {
    const loom::cuda::Segment piece = p.pieces[i];
    uint64_t from = 0;
    uint64_t to = 0;
    if (!loom::cuda::spreadSlice(p, i, begin, end, &from, &to)) continue;
    uint64_t done = from;
    const uintptr_t ends =
        reinterpret_cast<uintptr_t>(piece.dst) | reinterpret_cast<uintptr_t>(piece.src);
    if (ends % 16 == 0) {
      const uint4* src = static_cast<const uint4*>(piece.src);
      uint4* dst = static_cast<uint4*>(piece.dst);
      const uint64_t last = to / 16;
      uint64_t v = from / 16 + threadIdx.x;
      for (; v + 3 * step < last; v += 4 * step) {
        const uint4 a = src[v];
        const uint4 b = src[v + step];
        const uint4 c = src[v + 2 * step];
        const uint4 d = src[v + 3 * step];
        dst[v] = a;
        dst[v + step] = b;
        dst[v + 2 * step] = c;
        dst[v + 3 * step] = d;
      }
      for (; v < last; v += step) dst[v] = src[v];
      done = last * 16;
    }
    const uint8_t* src = static_cast<const uint8_t*>(piece.src);
    uint8_t* dst = static_cast<uint8_t*>(piece.dst);
    for (uint64_t b = done + threadIdx.x; b < to; b += step) dst[b] = src[b];
  }
}

// The flag waits and writes of one step of an operation captured in a CUDA graph, by one
// thread (see FlagParams). A spinning wait, where eager operations let the GPU's front end
// wait (cuStreamBatchMemOp): a graph's memory-operation nodes hold fixed values, and each
// replay needs the values of its own epoch. The wait gives up when the communicator fails
// (the executor also raises every flag then).
extern "C" __global__ void loom_flags(FlagParams p) {
  using Flag = ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system>;
  for (int i = 0; i < p.count; ++i) {
    Flag flag(*p.ops[i].flag);
    const uint64_t value = *p.ops[i].base + p.ops[i].offset;
    if (!p.ops[i].wait) {
      // Release: the earlier kernels of this stream wrote what the flag announces (their
      // writes happen before this kernel starts, by stream order; the release makes them
      // visible to a peer that acquires the flag, whose later kernels then read them).
      flag.store(value, ::cuda::memory_order_release);
      continue;
    }
    if (static_cast<int64_t>(flag.load(::cuda::memory_order_acquire) - value) >= 0) continue;
    p.waiting[1] = value;  // the value first: a record with an address is whole
    __threadfence_system();
    p.waiting[0] = reinterpret_cast<uint64_t>(p.ops[i].flag);
    __threadfence_system();
    while (static_cast<int64_t>(flag.load(::cuda::memory_order_acquire) - value) < 0) {
      if (*p.abort != 0) return;
      __nanosleep(200);
    }
    p.waiting[0] = 0;
  }
  for (int i = 0; i < p.nadvance; ++i) *p.advances[i].word += p.advances[i].by;
}
