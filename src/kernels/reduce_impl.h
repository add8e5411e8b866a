#pragma once

// The reduction kernels, written once and compiled per instruction set. Each
// reduce_<isa>.cc defines the two 16-bit-float block converters below and then includes
// this file; everything here sits in an anonymous namespace so each ISA's instantiations
// keep internal linkage (the linker must never hand the portable path an AVX-512 copy).
// Loops are plain and branch-free so the compiler vectorises them for the file's -m flags;
// the source order and the single rounding per element keep results identical across ISAs
// (the build turns off FMA contraction, which would change rounding).
//
// The including file must define, before including:
//   void loadFp16(const uint16_t* src, float* dst, size_t n);
//   void storeFp16(const float* src, uint16_t* dst, size_t n);

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/half.h"
#include "kernels/reduce.h"

namespace {

using loom::DataType;
using loom::ReduceKind;
using loom::kernels::ReduceSpec;

// Elements per block: the accumulators of one block stay in L1 while every source streams.
constexpr size_t kBlock = 512;

struct Fp16 {
  uint16_t bits;
};
struct Bf16 {
  uint16_t bits;
};

// Storage type -> accumulator type.
template <class S>
struct AccOf {
  using type = S;
};
template <>
struct AccOf<Fp16> {
  using type = float;
};
template <>
struct AccOf<Bf16> {
  using type = float;
};

// Converts a block of storage elements to accumulators.
template <class S, class A>
inline void loadBlock(const S* src, A* dst, size_t n) {
  if constexpr (std::is_same_v<S, Fp16>) {
    loadFp16(reinterpret_cast<const uint16_t*>(src), dst, n);
  } else if constexpr (std::is_same_v<S, Bf16>) {
    const auto* s = reinterpret_cast<const uint16_t*>(src);
    for (size_t j = 0; j < n; ++j) dst[j] = loom::kernels::bf16ToFloat(s[j]);
  } else {
    for (size_t j = 0; j < n; ++j) dst[j] = static_cast<A>(src[j]);
  }
}

// Rounds a block of accumulators to storage elements.
template <class S, class A>
inline void storeBlock(const A* src, S* dst, size_t n) {
  if constexpr (std::is_same_v<S, Fp16>) {
    storeFp16(src, reinterpret_cast<uint16_t*>(dst), n);
  } else if constexpr (std::is_same_v<S, Bf16>) {
    auto* d = reinterpret_cast<uint16_t*>(dst);
    for (size_t j = 0; j < n; ++j) d[j] = loom::kernels::floatToBf16(src[j]);
  } else {
    for (size_t j = 0; j < n; ++j) dst[j] = static_cast<S>(src[j]);
  }
}

// Wrapping integer arithmetic (signed overflow is undefined in C++; unsigned wraps).
template <class T>
using Wide = std::conditional_t<(sizeof(T) < 4), uint32_t, std::make_unsigned_t<T>>;
template <class T>
inline T wrapAdd(T a, T b) {
  return static_cast<T>(static_cast<Wide<T>>(a) + static_cast<Wide<T>>(b));
}
template <class T>
inline T wrapMul(T a, T b) {
  return static_cast<T>(static_cast<Wide<T>>(a) * static_cast<Wide<T>>(b));
}

// One binary combine per reduce kind. Floating min/max propagate NaN like torch.minimum.
template <ReduceKind K, class A>
inline A combine(A a, A b) {
  if constexpr (K == ReduceKind::kSum || K == ReduceKind::kAvg || K == ReduceKind::kPremulSum) {
    if constexpr (std::is_integral_v<A>)
      return wrapAdd(a, b);
    else
      return a + b;
  } else if constexpr (K == ReduceKind::kProduct) {
    if constexpr (std::is_integral_v<A>)
      return wrapMul(a, b);
    else
      return a * b;
  } else if constexpr (K == ReduceKind::kMin) {
    // Ties keep `a`, the earlier ranks' value (+0 and -0 compare equal), at every size and
    // on every rank (torch.minimum's and Gloo's choice between -0 and +0 depends on the
    // element's place); NaN wins either way.
    if constexpr (std::is_floating_point_v<A>)
      return (b < a || b != b) ? b : a;
    else
      return b < a ? b : a;
  } else if constexpr (K == ReduceKind::kMax) {
    if constexpr (std::is_floating_point_v<A>)
      return (b > a || b != b) ? b : a;
    else
      return b > a ? b : a;
  } else if constexpr (K == ReduceKind::kBitAnd) {
    return static_cast<A>(a & b);
  } else if constexpr (K == ReduceKind::kBitOr) {
    return static_cast<A>(a | b);
  } else {
    return static_cast<A>(a ^ b);
  }
}

// The block loop: acc = f(src0); acc = acc (op) f(src_s) for s = 1..n-1; finalize; store.
template <class S, class A, ReduceKind K>
void reduceTyped(S* dst, const S* const* srcs, int nsrc, size_t count, A factor, A divisor) {
  constexpr bool kPremul = K == ReduceKind::kPremulSum;
  constexpr bool kAvg = K == ReduceKind::kAvg;
  alignas(64) A acc[kBlock];
  alignas(64) A tmp[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = count - base < kBlock ? count - base : kBlock;
    loadBlock(srcs[0] + base, acc, n);
    if constexpr (kPremul) {
      for (size_t j = 0; j < n; ++j) acc[j] = acc[j] * factor;
    }
    for (int s = 1; s < nsrc; ++s) {
      const S* src = srcs[s] + base;
      if constexpr (std::is_same_v<S, A> && !kPremul) {
        for (size_t j = 0; j < n; ++j) acc[j] = combine<K>(acc[j], src[j]);
      } else {
        loadBlock(src, tmp, n);
        if constexpr (kPremul) {
          for (size_t j = 0; j < n; ++j) acc[j] = acc[j] + tmp[j] * factor;
        } else {
          for (size_t j = 0; j < n; ++j) acc[j] = combine<K>(acc[j], tmp[j]);
        }
      }
    }
    if constexpr (kAvg) {
      for (size_t j = 0; j < n; ++j) acc[j] = acc[j] / divisor;
    }
    storeBlock(acc, dst + base, n);
  }
}

// Dispatch on the reduce kind for storage S with accumulator A.
template <class S, class A = typename AccOf<S>::type>
void reduceKinds(void* dst, const void* const* srcs, int nsrc, size_t count,
                 const ReduceSpec& spec) {
  auto* d = static_cast<S*>(dst);
  auto* s = reinterpret_cast<const S* const*>(srcs);
  const A factor = static_cast<A>(spec.op.factor());
  const A ranks = static_cast<A>(spec.ranks);
  switch (spec.op.kind()) {
    case ReduceKind::kSum:
      return reduceTyped<S, A, ReduceKind::kSum>(d, s, nsrc, count, factor, ranks);
    case ReduceKind::kProduct:
      return reduceTyped<S, A, ReduceKind::kProduct>(d, s, nsrc, count, factor, ranks);
    case ReduceKind::kMin:
      return reduceTyped<S, A, ReduceKind::kMin>(d, s, nsrc, count, factor, ranks);
    case ReduceKind::kMax:
      return reduceTyped<S, A, ReduceKind::kMax>(d, s, nsrc, count, factor, ranks);
    case ReduceKind::kAvg:
      if constexpr (std::is_integral_v<S>) {
        // Integer AVG sums in int64 so small types do not wrap before the division.
        return reduceTyped<S, int64_t, ReduceKind::kAvg>(d, s, nsrc, count, 1, spec.ranks);
      } else {
        return reduceTyped<S, A, ReduceKind::kAvg>(d, s, nsrc, count, factor, ranks);
      }
    case ReduceKind::kPremulSum:
      if constexpr (std::is_floating_point_v<A>) {
        return reduceTyped<S, A, ReduceKind::kPremulSum>(d, s, nsrc, count, factor, ranks);
      }
      break;
    case ReduceKind::kBitAnd:
    case ReduceKind::kBitOr:
    case ReduceKind::kBitXor:
      if constexpr (std::is_integral_v<A>) {
        if (spec.op.kind() == ReduceKind::kBitAnd)
          return reduceTyped<S, A, ReduceKind::kBitAnd>(d, s, nsrc, count, factor, ranks);
        if (spec.op.kind() == ReduceKind::kBitOr)
          return reduceTyped<S, A, ReduceKind::kBitOr>(d, s, nsrc, count, factor, ranks);
        return reduceTyped<S, A, ReduceKind::kBitXor>(d, s, nsrc, count, factor, ranks);
      }
      break;
  }
  // Validation rejects unsupported (kind, type) pairs before any kernel runs.
  __builtin_trap();
}

// Bool: SUM, MAX and BOR are logical or; PRODUCT, MIN and BAND are logical and; BXOR is
// logical xor. Each byte is a truth value, nonzero true, as torch reads a bool tensor made
// from other bytes (uint8_mask.view(torch.bool)): combined bit by bit, 2 and 1 (both true)
// made 0 (false) under PRODUCT and MIN. Results are 0 or 1.
template <class Combine>
void reduceTruth(uint8_t* d, const uint8_t* const* s, int nsrc, size_t count, Combine combine) {
  for (size_t i = 0; i < count; ++i) {
    bool acc = s[0][i] != 0;
    for (int k = 1; k < nsrc; ++k) acc = combine(acc, s[k][i] != 0);
    d[i] = acc ? 1 : 0;
  }
}

void reduceBool(void* dst, const void* const* srcs, int nsrc, size_t count,
                const ReduceSpec& spec) {
  auto* d = static_cast<uint8_t*>(dst);
  auto* s = reinterpret_cast<const uint8_t* const*>(srcs);
  switch (spec.op.kind()) {
    case ReduceKind::kSum:
    case ReduceKind::kMax:
    case ReduceKind::kBitOr:
      return reduceTruth(d, s, nsrc, count, [](bool a, bool b) { return a || b; });
    case ReduceKind::kProduct:
    case ReduceKind::kMin:
    case ReduceKind::kBitAnd:
      return reduceTruth(d, s, nsrc, count, [](bool a, bool b) { return a && b; });
    case ReduceKind::kBitXor:
      return reduceTruth(d, s, nsrc, count, [](bool a, bool b) { return a != b; });
    default: __builtin_trap();
  }
}

// The ISA's entry point body: dispatch on the data type.
void reduceAnyType(void* dst, const void* const* srcs, int nsrc, size_t count,
                   const ReduceSpec& spec) {
  switch (spec.type) {
    case DataType::kFloat32: return reduceKinds<float>(dst, srcs, nsrc, count, spec);
    case DataType::kFloat64: return reduceKinds<double>(dst, srcs, nsrc, count, spec);
    case DataType::kFloat16: return reduceKinds<Fp16>(dst, srcs, nsrc, count, spec);
    case DataType::kBFloat16: return reduceKinds<Bf16>(dst, srcs, nsrc, count, spec);
    case DataType::kInt8: return reduceKinds<int8_t>(dst, srcs, nsrc, count, spec);
    case DataType::kUInt8: return reduceKinds<uint8_t>(dst, srcs, nsrc, count, spec);
    case DataType::kInt16: return reduceKinds<int16_t>(dst, srcs, nsrc, count, spec);
    case DataType::kInt32: return reduceKinds<int32_t>(dst, srcs, nsrc, count, spec);
    case DataType::kInt64: return reduceKinds<int64_t>(dst, srcs, nsrc, count, spec);
    case DataType::kBool: return reduceBool(dst, srcs, nsrc, count, spec);
  }
  __builtin_trap();
}

}  // namespace
