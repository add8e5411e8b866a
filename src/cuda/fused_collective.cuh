#pragma once

// The fused collectives (FusedParams in kernel_params.h says what they do): a whole call in
// one cooperative launch, for ranks that each have a GPU of their own, where the stepped
// path pays a round of stream waits and launches per step (docs/PERFORMANCE.md, "Where a
// large call's time goes"). Pushing blocks write this rank's parts into its peers' slots
// over NVLink while receiving blocks reduce or copy out what the peers pushed here, so the
// link stays busy meanwhile; a step fills slot epoch % depth. Included by kernels.cu, which
// instantiates the reduction per element type and ReduceOp, and the copy once (in bytes).

#include <cuda/atomic>

#include "cuda/kernel_common.cuh"
#include "cuda/kernel_params.h"

namespace loom::cuda::device {

using SystemFlag = ::cuda::atomic_ref<uint64_t, ::cuda::thread_scope_system>;

// Flags compare as signed differences, as the stream waits do (GEQ on epochs that never wrap).
__device__ inline bool reached(uint64_t* flag, uint64_t value) {
  return static_cast<int64_t>(SystemFlag(*flag).load(::cuda::memory_order_acquire) - value) >= 0;
}
// A release at system scope. Raised after a __syncthreads, it also publishes what every
// thread of the block wrote before the barrier (the barrier orders their writes before the
// raising thread's, and release is cumulative in the PTX memory model), so a block pays
// one fence per flag instead of one per thread.
__device__ inline void raise(uint64_t* flag, uint64_t value) {
  SystemFlag(*flag).store(value, ::cuda::memory_order_release);
}

// In `owner`'s flags: `sender`'s slice `block` of a step has arrived in owner's slot.
__device__ inline uint64_t* arrivedFlag(const FusedParams& p, int owner, int sender, int block) {
  return p.blockFlags[owner] + sender * kMaxFusedBlocks + block;
}
// In `owner`'s flags: `reader` is done with what owner pushed into reader's slot.
__device__ inline uint64_t* freedFlag(const FusedParams& p, int owner, int reader, int block) {
  return p.blockFlags[owner] + kMaxSources * kMaxFusedBlocks + reader * kMaxFusedBlocks + block;
}
// Two-shot, in `owner`'s flags: `sender`'s reduced slice `block` has arrived in owner's
// gather region for it; `reader` is done with what owner pushed into reader's gather region.
__device__ inline uint64_t* gatheredFlag(const FusedParams& p, int owner, int sender, int block) {
  return p.blockFlags[owner] + 2 * kMaxSources * kMaxFusedBlocks + sender * kMaxFusedBlocks + block;
}
__device__ inline uint64_t* gatherFreedFlag(const FusedParams& p, int owner, int reader,
                                            int block) {
  return p.blockFlags[owner] + 3 * kMaxSources * kMaxFusedBlocks + reader * kMaxFusedBlocks + block;
}
// Where the slot of step `epoch` starts, in bytes from slot 0 (the same on every rank).
__device__ inline uint64_t slotOf(const FusedParams& p, uint64_t epoch) {
  return (epoch % static_cast<uint64_t>(p.depth)) * p.slotBytes;
}
// Where `sender`'s pushes land in `receiver`'s slot at `slot` bytes (slotOf).
__device__ inline uint8_t* region(const FusedParams& p, int sender, int receiver, uint64_t slot) {
  const int index = sender < receiver ? sender : sender - 1;
  return p.slots[receiver] + slot + index * p.regionBytes;
}

// Calls fn(q) for each peer q in `mask`, in the turns `block` of this rank sends in
// (fusedPeerInTurn), so no two ranks' same blocks pour into one peer at once.
template <class Fn>
__device__ inline void forPeersInTurn(const FusedParams& p, int block, uint32_t mask, Fn fn) {
  for (int k = 0; k < p.size - 1; ++k) {
    const int q = fusedPeerInTurn(p.rank, p.size, block, k);
    if (mask >> q & 1u) fn(q);
  }
}

// Records, in thread 0 of the block, the GPU's global time at `phase` of `step` (FusedParams'
// trace; debug only, one untaken branch when off).
__device__ inline void mark(const FusedParams& p, uint64_t step, int phase) {
  if (p.trace == nullptr || threadIdx.x != 0 || step >= p.traceSteps) return;
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  p.trace[(blockIdx.x * p.traceSteps + step) * kTracePhases + phase] = now;
  if (step == 0 && phase == 0) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    p.traceSms[blockIdx.x] = sm;
  }
}

// Marks a step's waits as over where it has one wait or none (both trace points at once).
__device__ inline void markWaited(const FusedParams& p, uint64_t step) {
  mark(p, step, 1);
  mark(p, step, 2);
}

// This rank's descriptor of the call as its peers must find it (with a device factor's bits).
__device__ inline Descriptor mineOf(const FusedParams& p) {
  return withFactor(p.mine, p.factorAt);
}

// In the call's first step, thread 0 of every block publishes this rank's descriptor
// before the block raises its first arrival (which is what a peer's check follows), and
// block 0 raises the collective "ready" flag, so that a peer running another operation can
// name the mismatch.
__device__ inline void publishOnce(const FusedParams& p, int block, uint64_t step, uint64_t epoch) {
  if (step != 0 || threadIdx.x != 0) return;
  *p.descriptors[p.rank] = mineOf(p);
  if (block == 0) {
    __threadfence_system();
    raise(p.ready[p.rank], epoch);
  }
}

// A load that skips the SM's L1: a slot is refilled by a peer at the same addresses two
// steps later, and L1 is not kept coherent with writes that come over NVLink.
template <class S>
__device__ inline S loadFresh(const S* at) {
  using Raw = std::conditional_t<
      sizeof(S) == 1, unsigned char,
      std::conditional_t<sizeof(S) == 2, unsigned short,
                         std::conditional_t<sizeof(S) == 4, unsigned, unsigned long long>>>;
  const Raw raw = __ldcg(reinterpret_cast<const Raw*>(at));
  S value;
  memcpy(&value, &raw, sizeof value);
  return value;
}

// This block copies `bytes` from src to each of dsts[0..ndst): four 16-byte vectors in
// flight per thread where every end is aligned, bytes elsewhere; loads skip L1 (see
// loadFresh). One read serves every destination.
__device__ inline void copyToEach(uint8_t* const* dsts, int ndst, const uint8_t* src,
                                  uint64_t bytes) {
  uint64_t done = 0;
  uintptr_t ends = reinterpret_cast<uintptr_t>(src);
  for (int j = 0; j < ndst; ++j) ends |= reinterpret_cast<uintptr_t>(dsts[j]);
  if (ends % 16 == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    const uint64_t last = bytes / 16;
    const unsigned step = blockDim.x;
    uint64_t v = threadIdx.x;
    for (; v + 3 * step < last; v += 4 * step) {
      const uint4 a = __ldcg(s + v);
      const uint4 b = __ldcg(s + v + step);
      const uint4 c = __ldcg(s + v + 2 * step);
      const uint4 e = __ldcg(s + v + 3 * step);
      for (int j = 0; j < ndst; ++j) {
        uint4* d = reinterpret_cast<uint4*>(dsts[j]);
        d[v] = a;
        d[v + step] = b;
        d[v + 2 * step] = c;
        d[v + 3 * step] = e;
      }
    }
    for (; v < last; v += step) {
      const uint4 a = __ldcg(s + v);
      for (int j = 0; j < ndst; ++j) reinterpret_cast<uint4*>(dsts[j])[v] = a;
    }
    done = last * 16;
  }
  for (uint64_t i = done + threadIdx.x; i < bytes; i += blockDim.x) {
    const uint8_t byte = loadFresh(src + i);
    for (int j = 0; j < ndst; ++j) dsts[j][i] = byte;
  }
}

// This block copies `bytes` from src to dst (copyToEach).
__device__ inline void copyByBlock(uint8_t* dst, const uint8_t* src, uint64_t bytes) {
  copyToEach(&dst, 1, src, bytes);
}

// This block's dsts[j][i] = op over srcs[0..nsrc)[i], in source order, for i < n and every
// j < ndst: one reduction serves every destination. A ring's partial result comes in as
// srcs[0] already scaled (`scaleFirst` false: PREMUL_SUM's factor spares it) and leaves
// unfinished (`finish` false: AVG's division waits for the last rank's part).
template <class S, class A, int K>
__device__ void reduceToEach(S* const* dsts, int ndst, const S* const* srcs, int nsrc, uint64_t n,
                             double factor, double divisor, bool scaleFirst = true,
                             bool finish = true) {
  constexpr int kV = 16 / sizeof(S);
  bool aligned = true;
  for (int j = 0; j < ndst; ++j) aligned &= reinterpret_cast<uintptr_t>(dsts[j]) % 16 == 0;
  for (int s = 0; s < nsrc; ++s) aligned &= reinterpret_cast<uintptr_t>(srcs[s]) % 16 == 0;
  const uint64_t vectors = aligned ? n / kV : 0;
  union Pack {
    uint4 raw;
    S e[kV];
  };
  for (uint64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
    Pack in;
    A acc[kV];
    in.raw = __ldcg(reinterpret_cast<const uint4*>(srcs[0]) + v);
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      acc[j] = widen<A>(in.e[j]);
      if constexpr (K == kPremulSum) {
        if (scaleFirst) acc[j] = acc[j] * static_cast<A>(factor);
      }
    }
    for (int s = 1; s < nsrc; ++s) {
      in.raw = __ldcg(reinterpret_cast<const uint4*>(srcs[s]) + v);
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        const A x = widen<A>(in.e[j]);
        if constexpr (K == kPremulSum)
          acc[j] = acc[j] + x * static_cast<A>(factor);
        else
          acc[j] = combine<K>(acc[j], x);
      }
    }
    Pack out;
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      if constexpr (K == kAvg) {
        if (finish) acc[j] = acc[j] / static_cast<A>(divisor);
      }
      out.e[j] = narrow<S>(acc[j]);
    }
    for (int j = 0; j < ndst; ++j) reinterpret_cast<uint4*>(dsts[j])[v] = out.raw;
  }
  for (uint64_t i = vectors * kV + threadIdx.x; i < n; i += blockDim.x) {
    A acc = widen<A>(loadFresh(srcs[0] + i));
    if constexpr (K == kPremulSum) {
      if (scaleFirst) acc = acc * static_cast<A>(factor);
    }
    for (int s = 1; s < nsrc; ++s) {
      const A x = widen<A>(loadFresh(srcs[s] + i));
      if constexpr (K == kPremulSum)
        acc = acc + x * static_cast<A>(factor);
      else
        acc = combine<K>(acc, x);
    }
    if constexpr (K == kAvg) {
      if (finish) acc = acc / static_cast<A>(divisor);
    }
    for (int j = 0; j < ndst; ++j) dsts[j][i] = narrow<S>(acc);
  }
}

// This block's dst[i] = op over srcs[0..nsrc)[i] (reduceToEach).
template <class S, class A, int K>
__device__ void reduceByBlock(S* dst, const S* const* srcs, int nsrc, uint64_t n, double factor,
                              double divisor) {
  reduceToEach<S, A, K>(&dst, 1, srcs, nsrc, n, factor, divisor);
}

// One thread's wait for `flag` to reach `value`; false if the communicator failed first.
__device__ inline bool awaitFlag(uint64_t* flag, uint64_t value, const volatile uint64_t* abort) {
  while (!reached(flag, value)) {
    if (*abort != 0) return false;
    __nanosleep(32);
  }
  return true;
}

// A pushing block's step: once every receiver is done with what this block pushed `depth`
// steps ago, write this rank's slice of each receiver's part into its slot and say so.
// Elements [lo + from, lo + from + n) of each part, of `size` bytes each.
__device__ inline bool pushStep(const FusedParams& p, int block, uint64_t step, uint64_t epoch,
                                uint64_t lo, uint64_t from, uint64_t n, uint64_t size) {
  const int t = threadIdx.x;
  const bool pushes = t < p.size && (p.pushesTo >> t & 1u);
  bool ok = true;
  if (step >= static_cast<uint64_t>(p.depth) && pushes) {
    ok = awaitFlag(freedFlag(p, p.rank, t, block), epoch - p.depth, p.abort);
  }
  if (!__syncthreads_and(ok)) return false;
  markWaited(p, step);
  publishOnce(p, block, step, epoch);
  const uint64_t slot = slotOf(p, epoch);
  forPeersInTurn(p, block, p.pushesTo, [&](int q) {
    copyByBlock(region(p, p.rank, q, slot) + from * size,
                static_cast<const uint8_t*>(p.sources[q]) + (lo + from) * size, n * size);
  });
  // Every thread's writes reach the system before any arrival is raised (see raise).
  __syncthreads();
  // The arrival in this rank's own flags tells its receiving block that this slice of every
  // part has been read, so an in-place call may overwrite it.
  if (pushes || t == p.rank) raise(arrivedFlag(p, t, p.rank, block), epoch);
  return true;
}

// Waits (thread t for rank t, for each rank in `mask`) until each one's flag reaches
// `value`; the block agrees on the outcome. In the first step (`check`), a peer found
// running another call is reported as a mismatch.
template <class FlagOf>
__device__ bool awaitPeers(const FusedParams& p, uint32_t mask, FlagOf flagOf, uint64_t value,
                           bool check) {
  const int t = threadIdx.x;
  bool ok = true;
  if (t < p.size && (mask >> t & 1u)) {
    const Descriptor mine = check ? mineOf(p) : Descriptor{};
    auto theirs = [&] { return readDescriptor(p.descriptors[t]); };
    uint64_t* flag = flagOf(t);
    while (ok && !reached(flag, value)) {
      if (*p.abort != 0) {
        ok = false;
      } else if (check && reached(p.ready[t], value) && !sameDescriptor(theirs(), mine)) {
        ok = false;  // a peer on another operation raises only its ready flag
      } else {
        __nanosleep(32);
      }
    }
    if (check && *p.abort == 0) {
      const Descriptor d = theirs();
      if (!sameDescriptor(d, mine)) {
        reportMismatch(p.claim, p.report, p.abort, t, mine, d);
        ok = false;
      }
    }
  }
  return __syncthreads_and(ok);
}

// Raises, for each rank t in `mask`, the flag flagOf(t) to `value`.
template <class FlagOf>
__device__ void raisePeers(const FusedParams& p, uint32_t mask, FlagOf flagOf, uint64_t value) {
  const int t = threadIdx.x;
  if (t < p.size && (mask >> t & 1u)) raise(flagOf(t), value);
}

// A receiving block's step: wait until every sender's slice has arrived (checking, in the
// first step, that each runs this very call), reduce or copy it out, free the senders'
// regions.
template <class S, class A, int K, bool kReduces>
__device__ bool receiveStep(const FusedParams& p, int block, uint64_t step, uint64_t epoch,
                            uint64_t lo, uint64_t from, uint64_t n) {
  // Every sender's slice, and this rank's own pusher's (then an in-place call may overwrite
  // its input). The descriptor check passes for this rank itself: its pushing blocks publish
  // the descriptor before they raise its own arrival or its ready flag.
  const uint32_t senders = p.receivesFrom & ~(1u << p.rank);
  if (!awaitPeers(
          p, senders | 1u << p.rank, [&](int q) { return arrivedFlag(p, p.rank, q, block); }, epoch,
          step == 0)) {
    return false;
  }
  markWaited(p, step);
  const uint64_t slot = slotOf(p, epoch);
  auto received = [&](int q) {
    return reinterpret_cast<const S*>(region(p, q, p.rank, slot)) + from;
  };
  if constexpr (kReduces) {
    const S* srcs[kMaxSources];
    for (int q = 0; q < p.size; ++q) {
      srcs[q] = q == p.rank ? static_cast<const S*>(p.own) + lo + from : received(q);
    }
    reduceByBlock<S, A, K>(static_cast<S*>(p.outputs[0]) + lo + from, srcs, p.size, n,
                           factorOf(p.factor, p.factorAt), p.divisor);
  } else {
    for (int q = 0; q < p.size; ++q) {
      const S* src = nullptr;
      if (q == p.rank && p.own != nullptr) src = static_cast<const S*>(p.own) + lo + from;
      if (q != p.rank && (p.receivesFrom >> q & 1u)) src = received(q);
      S* dst = static_cast<S*>(p.outputs[q]) + lo + from;
      if (src != nullptr && src != dst) {
        copyByBlock(reinterpret_cast<uint8_t*>(dst), reinterpret_cast<const uint8_t*>(src),
                    n * sizeof(S));
      }
    }
  }
  __syncthreads();  // every thread's loads are done (their values are stored)
  raisePeers(
      p, senders, [&](int q) { return freedFlag(p, q, p.rank, block); }, epoch);
  return true;
}

// Two shots (FusedParams): all_reduce (every rank contributes and owns a share) or
// broadcast (the root alone contributes, every other rank owns a share). Blocks of role 0
// (fusedRole) push each contributor's share q to its owner q, of role 1 reduce (or copy) an
// owner's share into the output and push it to every other owner, of role 2 copy the other
// owners' shares into the output.
template <class S, class A, int K, bool kReduces>
__device__ void twoShot(const FusedParams& p) {
  const int role = fusedRole(static_cast<int>(blockIdx.x), 3);
  const int block = fusedRoleBlock(static_cast<int>(blockIdx.x), 3);
  constexpr uint64_t kV = 16 / sizeof(S);
  const S* input = static_cast<const S*>(p.own);
  S* output = static_cast<S*>(p.outputs[0]);
  const uint32_t all = p.size == 32 ? ~0u : (1u << p.size) - 1;
  const uint32_t peers = all & ~(1u << p.rank);
  // Who contributes to each share and who owns one: everyone for all_reduce; for broadcast
  // the root, and everyone but the root. An owner's result goes to the other owners, and
  // it reads theirs.
  const bool everyone = p.root < 0;
  const uint32_t contributors = everyone ? all : 1u << p.root;
  const uint32_t owners = everyone ? all : all & ~(1u << p.root);
  const uint32_t others = owners & ~(1u << p.rank);
  const bool contributes = contributors >> p.rank & 1u;
  const bool owns = owners >> p.rank & 1u;
  for (uint64_t step = 0; step < p.steps; ++step) {
    const uint64_t epoch = p.firstEpoch + step;
    const uint64_t lo = step * p.perStep;
    const uint64_t n = p.count - lo < p.perStep ? p.count - lo : p.perStep;
    const uint64_t slot = slotOf(p, epoch);
    // Elements [from, to) of share q of this step (whole 16-byte vectors, in the same place
    // of the share in every step: fusedSlice), and `at`, the slice's bytes into a region.
    uint64_t from = 0;
    uint64_t to = 0;
    uint64_t at = 0;
    auto slice = [&](int q) {
      const uint64_t first = twoShotShareIndex(q, p.root) * p.share;
      const uint64_t start = first < n ? first : n;
      const uint64_t end = start + p.share < n ? start + p.share : n;
      const FusedSlice s = fusedSlice(p.share, end - start, p.blocks, block, kV);
      from = start + s.from;
      to = start + s.to;
      at = s.from * sizeof(S);
    };
    mark(p, step, 0);
    if (role == 0) {
      publishOnce(p, block, step, epoch);
      if (!contributes) continue;
      if (step >= static_cast<uint64_t>(p.depth) &&
          !awaitPeers(
              p, owners & peers, [&](int q) { return freedFlag(p, p.rank, q, block); },
              epoch - p.depth, false)) {
        return;
      }
      markWaited(p, step);
      forPeersInTurn(p, block, owners, [&](int q) {
        slice(q);
        copyByBlock(region(p, p.rank, q, slot) + at,
                    reinterpret_cast<const uint8_t*>(input + lo + from), (to - from) * sizeof(S));
      });
      __syncthreads();
      raisePeers(
          p, owners & peers, [&](int q) { return arrivedFlag(p, q, p.rank, block); }, epoch);
      mark(p, step, 3);
    } else if (role == 1) {
      if (!owns) continue;
      const uint32_t senders = contributors & ~(1u << p.rank);
      if (!awaitPeers(
              p, senders, [&](int q) { return arrivedFlag(p, p.rank, q, block); }, epoch,
              step == 0)) {
        return;
      }
      mark(p, step, 1);
      if (step >= static_cast<uint64_t>(p.depth) &&
          !awaitPeers(
              p, others, [&](int q) { return gatherFreedFlag(p, p.rank, q, block); },
              epoch - p.depth, false)) {
        return;
      }
      mark(p, step, 2);
      slice(p.rank);
      // The result goes to the output and, in the same pass, to every other owner's gather
      // region (in turn order), so it is never read back.
      S* dsts[kMaxSources];
      int ndst = 0;
      dsts[ndst++] = output + lo + from;
      forPeersInTurn(p, block, others, [&](int q) {
        dsts[ndst++] = reinterpret_cast<S*>(region(p, p.rank, q, slot + p.gatherAt) + at);
      });
      if constexpr (kReduces) {
        const S* srcs[kMaxSources];
        for (int q = 0; q < p.size; ++q) {
          srcs[q] = q == p.rank ? input + lo + from
                                : reinterpret_cast<const S*>(region(p, q, p.rank, slot) + at);
        }
        reduceToEach<S, A, K>(dsts, ndst, srcs, p.size, to - from, factorOf(p.factor, p.factorAt),
                              p.divisor);
      } else {
        // A broadcast's owner is never its root: its share is what the root pushed here.
        copyToEach(reinterpret_cast<uint8_t* const*>(dsts), ndst,
                   region(p, p.root, p.rank, slot) + at, (to - from) * sizeof(S));
      }
      // One barrier serves both flags: every thread's loads of the contributors' regions are
      // done before "freed", and its writes to the peers are published by "gathered" (raise).
      __syncthreads();
      raisePeers(
          p, senders, [&](int q) { return freedFlag(p, q, p.rank, block); }, epoch);
      raisePeers(
          p, others, [&](int q) { return gatheredFlag(p, q, p.rank, block); }, epoch);
      mark(p, step, 3);
    } else if (owns) {
      // No descriptor check here: an owner may raise "gathered" before its own pushing
      // blocks publish the descriptor; every sender was checked by role 1 (or, for
      // broadcast, the root was, and a rank on another call finds it on its own side).
      if (!awaitPeers(
              p, others, [&](int q) { return gatheredFlag(p, p.rank, q, block); }, epoch, false)) {
        return;
      }
      markWaited(p, step);
      forPeersInTurn(p, block, others, [&](int q) {
        slice(q);
        copyByBlock(reinterpret_cast<uint8_t*>(output + lo + from),
                    region(p, q, p.rank, slot + p.gatherAt) + at, (to - from) * sizeof(S));
      });
      __syncthreads();
      raisePeers(
          p, others, [&](int q) { return gatherFreedFlag(p, q, p.rank, block); }, epoch);
      mark(p, step, 3);
    } else if (input != output) {
      // The broadcast's root: every share of its own input into its output.
      for (int q = 0; q < p.size; ++q) {
        if (!(owners >> q & 1u)) continue;
        slice(q);
        copyByBlock(reinterpret_cast<uint8_t*>(output + lo + from),
                    reinterpret_cast<const uint8_t*>(input + lo + from), (to - from) * sizeof(S));
      }
    }
  }
}

// The end of a chain's step or a ring's hop for `block`: once every thread's loads and
// stores are done, frees the slot hop `in` came in through at `prev` and says that hop `out`
// has arrived at `next` (-1: no such rank this time).
__device__ inline void passOn(const FusedParams& p, int block, int prev, uint64_t in, int next,
                              uint64_t out) {
  __syncthreads();  // every load done before "freed"; every write published by "arrived"
  if (prev >= 0) {
    raisePeers(
        p, 1u << prev, [&](int q) { return freedFlag(p, q, p.rank, block); }, in);
  }
  if (next >= 0) {
    raisePeers(
        p, 1u << next, [&](int q) { return arrivedFlag(p, q, p.rank, block); }, out);
  }
}

// A broadcast along a chain (FusedParams::chain).
__device__ inline void chainBroadcast(const FusedParams& p) {
  const int block = static_cast<int>(blockIdx.x);
  const auto [prev, next] = chainLinks(p.rank, p.size, p.root);
  const bool receives = prev >= 0;
  const bool sends = next >= 0;
  const uint8_t* input = static_cast<const uint8_t*>(p.own);
  uint8_t* output = static_cast<uint8_t*>(p.outputs[0]);
  for (uint64_t step = 0; step < p.steps; ++step) {
    const uint64_t epoch = p.firstEpoch + step;
    const uint64_t lo = step * p.perStep;
    const uint64_t n = p.count - lo < p.perStep ? p.count - lo : p.perStep;
    const uint64_t first = p.count < p.perStep ? p.count : p.perStep;
    const auto [from, to] = fusedSlice(first, n, p.blocks, block, 16);
    const uint64_t slot = slotOf(p, epoch);
    mark(p, step, 0);
    publishOnce(p, block, step, epoch);
    if (receives && !awaitPeers(
                        p, 1u << prev, [&](int q) { return arrivedFlag(p, p.rank, q, block); },
                        epoch, step == 0)) {
      return;
    }
    mark(p, step, 1);
    if (sends && step >= static_cast<uint64_t>(p.depth) &&
        !awaitPeers(
            p, 1u << next, [&](int q) { return freedFlag(p, p.rank, q, block); }, epoch - p.depth,
            false)) {
      return;
    }
    mark(p, step, 2);
    // One read serves the output and the next rank's slot (the root's own output only when
    // the call is not in place).
    uint8_t* dsts[2];
    int ndst = 0;
    if (receives || input != output) dsts[ndst++] = output + lo + from;
    if (sends) dsts[ndst++] = p.slots[next] + slot + from;
    copyToEach(dsts, ndst, receives ? p.slots[p.rank] + slot + from : input + lo + from, to - from);
    passOn(p, block, receives ? prev : -1, epoch, sends ? next : -1, epoch);
    mark(p, step, 3);
  }
}

// An all_reduce around a ring (FusedParams::chain, root < 0; ringShare). Only for element
// types that accumulate in themselves: a partial result crosses to the next rank in S.
template <class S, class A, int K>
__device__ void ringAllReduce(const FusedParams& p) {
  const int block = static_cast<int>(blockIdx.x);
  const int prev = (p.rank + p.size - 1) % p.size;
  const int next = (p.rank + 1) % p.size;
  const int hops = ringHops(p.size);
  constexpr uint64_t kV = 16 / sizeof(S);
  const S* input = static_cast<const S*>(p.own);
  S* output = static_cast<S*>(p.outputs[0]);
  for (uint64_t step = 0; step < p.steps; ++step) {
    const uint64_t lo = step * p.perStep;
    const uint64_t n = p.count - lo < p.perStep ? p.count - lo : p.perStep;
    const uint64_t base = p.firstEpoch + step * static_cast<uint64_t>(hops);
    mark(p, step, 0);
    publishOnce(p, block, step, base);
    for (int pass = 0; pass <= hops; ++pass) {
      // This block's slice of the pass's share: cut from a whole share (fusedSlice), so it
      // lies where it did in every earlier hop through the same slots.
      const uint64_t start = static_cast<uint64_t>(ringShare(p.rank, p.size, pass)) * p.share;
      const uint64_t first = start < n ? start : n;
      const uint64_t last = first + p.share < n ? first + p.share : n;
      const FusedSlice s = fusedSlice(p.share, last - first, p.blocks, block, kV);
      const bool receives = pass > 0;
      const bool sends = pass < hops;
      const uint64_t in = base + static_cast<uint64_t>(pass) - 1;  // hop pass - 1's epoch
      const uint64_t out = base + static_cast<uint64_t>(pass);
      if (receives && !awaitPeers(
                          p, 1u << prev, [&](int q) { return arrivedFlag(p, p.rank, q, block); },
                          in, step == 0 && pass == 1)) {
        return;
      }
      if (pass == 1) mark(p, step, 1);
      if (sends && out - p.firstEpoch >= static_cast<uint64_t>(p.depth) &&
          !awaitPeers(
              p, 1u << next, [&](int q) { return freedFlag(p, p.rank, q, block); }, out - p.depth,
              false)) {
        return;
      }
      const S* incoming = reinterpret_cast<const S*>(p.slots[p.rank] + slotOf(p, in)) + s.from;
      S* dsts[2];
      int ndst = 0;
      if (pass >= p.size - 1) dsts[ndst++] = output + lo + first + s.from;
      if (sends) dsts[ndst++] = reinterpret_cast<S*>(p.slots[next] + slotOf(p, out)) + s.from;
      if (pass < p.size) {
        // The share's partial sum so far, then this rank's part; an in-place call reads
        // its input here before pass size - 1 or later writes the same elements.
        const S* srcs[2] = {incoming, input + lo + first + s.from};
        reduceToEach<S, A, K>(dsts, ndst, receives ? srcs : srcs + 1, receives ? 2 : 1,
                              s.to - s.from, factorOf(p.factor, p.factorAt), p.divisor, !receives,
                              pass == p.size - 1);
      } else {
        copyToEach(reinterpret_cast<uint8_t* const*>(dsts), ndst,
                   reinterpret_cast<const uint8_t*>(incoming), (s.to - s.from) * sizeof(S));
      }
      if (pass == p.size - 1) mark(p, step, 2);
      passOn(p, block, receives ? prev : -1, in, sends ? next : -1, out);
    }
    mark(p, step, 3);
  }
}

// Rank q's "done" flag of `epoch` (FusedParams::toDone).
__device__ inline uint64_t* doneFlag(const FusedParams& p, int q, uint64_t epoch) {
  uint8_t* at = reinterpret_cast<uint8_t*>(p.ready[q]) + p.toDone;
  if ((epoch ^ p.firstEpoch) & 1) at += p.toOtherParity;
  return reinterpret_cast<uint64_t*>(at);
}

// Every block, before anything else: each peer is done with the slots (and descriptors)
// that this call's first two epochs reuse, those of the two epochs before it. (A peer's
// "done" of its last epochs covers all before them: its calls end in order.)
__device__ inline bool awaitSlotsFree(const FusedParams& p) {
  const int t = threadIdx.x;
  bool ok = true;
  if (t < p.size && t != p.rank) {
    for (uint64_t e = p.firstEpoch > 2 ? p.firstEpoch - 2 : 1; ok && e < p.firstEpoch; ++e) {
      ok = awaitFlag(doneFlag(p, t, e), e, p.abort);
    }
  }
  return __syncthreads_and(ok);
}

// Every block, last: the last of the call's blocks to finish (counted in p.exits) says
// that this rank is done with the slots of the call's last two epochs, as a stream write
// after the kernel would. Each block's loads and stores come before its count (the barrier,
// then a fence), and the count before the raise, so a peer that sees "done" may reuse them.
__device__ inline void finishBlock(const FusedParams& p) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence_system();
  const uint64_t finished = atomicAdd(reinterpret_cast<unsigned long long*>(p.exits), 1ull) + 1;
  if (finished != p.exitsWhenDone || *p.abort != 0) return;
  __threadfence_system();
  raise(doneFlag(p, p.rank, p.lastEpoch), p.lastEpoch);
  if (p.lastEpoch > p.firstEpoch) raise(doneFlag(p, p.rank, p.lastEpoch - 1), p.lastEpoch - 1);
}

template <class S, class A, int K, bool kReduces>
__device__ void fusedSteps(const FusedParams& p) {
  if constexpr (kReduces) {
    if constexpr (__is_same(S, A)) {
      if (p.chain) return ringAllReduce<S, A, K>(p);
    }
  } else {
    if (p.chain) return chainBroadcast(p);
  }
  if (p.twoShot) return twoShot<S, A, K, kReduces>(p);
  const bool pushes = fusedRole(static_cast<int>(blockIdx.x), 2) == 0;
  const int block = fusedRoleBlock(static_cast<int>(blockIdx.x), 2);
  constexpr uint64_t kV = 16 / sizeof(S);
  for (uint64_t step = 0; step < p.steps; ++step) {
    const uint64_t epoch = p.firstEpoch + step;
    const uint64_t lo = step * p.perStep;
    const uint64_t n = p.count - lo < p.perStep ? p.count - lo : p.perStep;
    // Slices of whole 16-byte vectors, so every block's vectors stay aligned.
    const uint64_t first = p.count < p.perStep ? p.count : p.perStep;
    const auto [from, to] = fusedSlice(first, n, p.blocks, block, kV);
    mark(p, step, 0);
    const bool ok =
        pushes ? pushStep(p, block, step, epoch, lo, from, to - from, sizeof(S))
               : receiveStep<S, A, K, kReduces>(p, block, step, epoch, lo, from, to - from);
    if (!ok) return;
    mark(p, step, 3);
  }
}

// Block 0, before its steps: the peers this rank takes nothing from (a broadcast's root's)
// run this very call. Without it two ranks that each name themselves the root would each
// keep their own buffer and succeed, or, in a call of more steps than slots, wait for
// "freed" flags that no receiver raises until the timeout. This rank publishes its own
// descriptor and "ready" first (publishOnce, again in its first step: the same values), so
// a peer that also checks this one, another self-named root, finds it rather than waiting
// for it; the non-roots' block 0 raise theirs before any wait of their steps. Their next
// call cannot replace that descriptor, for it first waits for this rank's "done"
// (awaitSlotsFree). On a mismatch the report sets the abort word, which releases this
// rank's other blocks.
__device__ inline bool checkQuietPeers(const FusedParams& p) {
  if (p.checksQuiet == 0 || blockIdx.x != 0) return true;
  publishOnce(p, 0, 0, p.firstEpoch);
  return awaitPeers(
      p, p.checksQuiet, [&](int q) { return p.ready[q]; }, p.firstEpoch, true);
}

// A fused call (FusedParams): its steps, between the waits and the "done" that bound it.
template <class S, class A, int K, bool kReduces>
__device__ void fusedCollective(const FusedParams& p) {
  if (awaitSlotsFree(p) && checkQuietPeers(p)) fusedSteps<S, A, K, kReduces>(p);
  finishBlock(p);
}

}  // namespace loom::cuda::device
