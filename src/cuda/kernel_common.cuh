#pragma once

// What loom's kernels share (included by kernels.cu, the one translation unit of the
// kernel image): the reduction's arithmetic per element type and ReduceOp, and the report
// of a peer found doing something else.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "cuda/kernel_params.h"

namespace loom::cuda::device {

enum Kind { kSum, kProduct, kMin, kMax, kAvg, kPremulSum, kBitAnd, kBitOr, kBitXor };

// The accumulator of a storage type: float for the half types.
template <class S>
struct Acc {
  using type = S;
};
template <>
struct Acc<__half> {
  using type = float;
};
template <>
struct Acc<__nv_bfloat16> {
  using type = float;
};

template <class A, class S>
__device__ inline A widen(S v) {
  return static_cast<A>(v);
}
template <>
__device__ inline float widen<float, __half>(__half v) {
  return __half2float(v);
}
template <>
__device__ inline float widen<float, __nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <class S, class A>
__device__ inline S narrow(A v) {
  return static_cast<S>(v);
}
template <>
__device__ inline __half narrow<__half, float>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ inline __nv_bfloat16 narrow<__nv_bfloat16, float>(float v) {
  return __float2bfloat16_rn(v);
}

// Wrapping integer arithmetic (signed overflow is undefined; unsigned wraps), as the CPU
// kernels' Wide<T>: narrow types widen to 32 bits.
template <class T>
using Wide = std::conditional_t<(sizeof(T) < 4), uint32_t, std::make_unsigned_t<T>>;

template <class A>
__device__ constexpr bool isFloat() {
  return __is_same(A, float) || __is_same(A, double);
}

// One binary combine; integers wrap, floating min/max propagate NaN (as torch.minimum).
template <int K, class A>
__device__ inline A combine(A a, A b) {
  if constexpr (K == kSum || K == kAvg || K == kPremulSum) {
    if constexpr (isFloat<A>()) {
      return a + b;
    } else {
      using U = Wide<A>;
      return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
    }
  } else if constexpr (K == kProduct) {
    if constexpr (isFloat<A>()) {
      return a * b;
    } else {
      using U = Wide<A>;
      return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
    }
  } else if constexpr (K == kMin) {
    if constexpr (isFloat<A>())
      return (a < b || a != a) ? a : b;
    else
      return a < b ? a : b;
  } else if constexpr (K == kMax) {
    if constexpr (isFloat<A>())
      return (a > b || a != a) ? a : b;
    else
      return a > b ? a : b;
  } else if constexpr (K == kBitAnd) {
    return static_cast<A>(a & b);
  } else if constexpr (K == kBitOr) {
    return static_cast<A>(a | b);
  } else {
    return static_cast<A>(a ^ b);
  }
}

// Tells the host that `peer` runs `theirs` where this rank runs `mine` (the first caller
// of all blocks writes the report) and stops the communicator's kernels.
// A descriptor as a peer left it (read fresh: the peer writes it).
__device__ inline Descriptor readDescriptor(const volatile Descriptor* d) {
  return {{d->words[0], d->words[1], d->words[2]}};
}
__device__ inline bool sameDescriptor(const Descriptor& a, const Descriptor& b) {
  return a.words[0] == b.words[0] && a.words[1] == b.words[1] && a.words[2] == b.words[2];
}
// `d` with the bits of a PREMUL_SUM factor kept in device memory as its third word (the host
// that encoded `d` could not read them); `d` itself where there is none.
__device__ inline Descriptor withFactor(Descriptor d, const double* factorAt) {
  if (factorAt != nullptr) d.words[2] = static_cast<uint64_t>(__double_as_longlong(*factorAt));
  return d;
}
// PREMUL_SUM's factor: the one in device memory where there is one.
__device__ inline double factorOf(double factor, const double* factorAt) {
  return factorAt != nullptr ? *factorAt : factor;
}

__device__ inline void reportMismatch(uint32_t* claim, MismatchReport* report,
                                      volatile uint64_t* abort, int peer, Descriptor mine,
                                      Descriptor theirs) {
  if (atomicCAS(claim, 0u, 1u) == 0u) {
    report->peer = peer;
    report->mine = mine;
    report->theirs = theirs;
    __threadfence_system();
    report->raised = 1;
  }
  *abort = 2;
}

}  // namespace loom::cuda::device
