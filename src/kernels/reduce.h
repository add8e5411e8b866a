#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

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
/// accumulate in float32 and round once; integer AVG accumulates in int64. dst may be one of
/// the sources (the same elements) but must not otherwise overlap one. With spec.streaming
/// the results go out through non-temporal stores, fenced before returning, unless dst is a
/// source: its lines were just read, so plain stores find them in cache.
void reduce(void* dst, const void* const* srcs, int nsrc, size_t count, const ReduceSpec& spec);

/// A reduction's sources advanced to one slice of their elements (up to 64 of them on the
/// stack): for reducing a buffer a part at a time.
class SourcesAt {
 public:
  SourcesAt(const void* const* srcs, int nsrc) : srcs_(srcs), nsrc_(nsrc), shifted_(onStack_) {
    if (nsrc > kOnStack) shifted_ = (onHeap_.resize(static_cast<size_t>(nsrc)), onHeap_.data());
  }
  SourcesAt(const SourcesAt&) = delete;
  SourcesAt& operator=(const SourcesAt&) = delete;
  /// The sources, each `offset` bytes further on (valid until the next call).
  const void* const* at(size_t offset) {
    for (int s = 0; s < nsrc_; ++s) shifted_[s] = static_cast<const uint8_t*>(srcs_[s]) + offset;
    return shifted_;
  }

 private:
  static constexpr int kOnStack = 64;
  const void* const* srcs_;
  int nsrc_;
  const void* onStack_[kOnStack];
  std::vector<const void*> onHeap_;
  const void** shifted_;
};

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
