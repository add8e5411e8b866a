#pragma once

#include <cstddef>
#include <string_view>

#include "loom/types.h"

namespace loom::kernels {

/// Instruction sets with their own compiled kernels.
enum class Isa { kPortable, kAvx2, kAvx512 };

/// "portable", "avx2", "avx512".
std::string_view isaName(Isa isa);

/// True if this CPU can run `isa`'s kernels (and this build contains them).
bool isaAvailable(Isa isa);

/// The ISA used by reduce(): the best available, or LOOM_ISA if set (an unavailable or
/// unknown LOOM_ISA throws Error(kInvalidArgument) naming the choices).
Isa activeIsa();

/// What the reduction needs besides the buffers.
struct ReduceSpec {
  DataType type;
  ReduceOp op;
  int ranks;               ///< the divisor for AVG
  bool streaming = false;  ///< write dst with non-temporal stores (outputs too large to cache)
};

/// dst[i] = op over s = 0..nsrc-1, in that order, of srcs[s][i], for i < count. Half types
/// accumulate in float32 and round once; integer AVG accumulates in int64. dst may equal
/// srcs[0] but must not otherwise overlap a source. With spec.streaming the results go out
/// through non-temporal stores, fenced before returning.
void reduce(void* dst, const void* const* srcs, int nsrc, size_t count, const ReduceSpec& spec);

/// The same with an explicit ISA (tests compare every ISA against the reference).
void reduceWith(Isa isa, void* dst, const void* const* srcs, int nsrc, size_t count,
                const ReduceSpec& spec);

/// Signature of one ISA's entry point.
using ReduceFn = void (*)(void* dst, const void* const* srcs, int nsrc, size_t count,
                          const ReduceSpec& spec);

// One per compiled ISA; defined in reduce_<isa>.cc.
void reducePortable(void*, const void* const*, int, size_t, const ReduceSpec&);
void reduceAvx2(void*, const void* const*, int, size_t, const ReduceSpec&);
void reduceAvx512(void*, const void* const*, int, size_t, const ReduceSpec&);

}  // namespace loom::kernels
