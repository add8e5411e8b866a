// Picks the reduction kernels for this CPU once, at first use.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kernels/copy.h"
#include "kernels/reduce.h"
#include "loom/error.h"

namespace loom::kernels {

std::string_view isaName(Isa isa) {
  switch (isa) {
    case Isa::kPortable: return "portable";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

bool isaAvailable(Isa isa) {
  switch (isa) {
    case Isa::kPortable: return true;
#if defined(LOOM_HAVE_X86_KERNELS)
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
#else
    case Isa::kAvx2:
    case Isa::kAvx512: return false;
#endif
  }
  return false;
}

namespace {

Isa chooseIsa() {
  const char* forced = std::getenv("LOOM_ISA");
  if (forced != nullptr && *forced != '\0') {
    for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512}) {
      if (isaName(isa) != forced) continue;
      if (!isaAvailable(isa)) {
        throw Error(ErrorCode::kInvalidArgument, "kernels", -1,
                    "LOOM_ISA=" + std::string(forced) +
                        " is not available on this CPU or in this build; unset it or use "
                        "portable");
      }
      return isa;
    }
    throw Error(ErrorCode::kInvalidArgument, "kernels", -1,
                "LOOM_ISA=" + std::string(forced) + " is unknown; use portable, avx2 or avx512");
  }
  if (isaAvailable(Isa::kAvx512)) return Isa::kAvx512;
  if (isaAvailable(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kPortable;
}

ReduceFn functionFor(Isa isa) {
  switch (isa) {
#if defined(LOOM_HAVE_X86_KERNELS)
    case Isa::kAvx2: return reduceAvx2;
    case Isa::kAvx512: return reduceAvx512;
#endif
    default: return reducePortable;
  }
}

// Reduces a piece at a time into a buffer that stays in L1, then streams the piece to dst. A
// plain store to a line not in cache reads it first (read-for-ownership): for an output
// that will not stay in cache anyway, that read is a third more memory traffic in a
// reduce_scatter of four ranks (each rank reads N and writes N / 4). The extra pass over
// the buffer is in L1, far cheaper than the read it saves.
void reduceStreaming(ReduceFn fn, void* dst, const void* const* srcs, int nsrc, size_t count,
                     const ReduceSpec& spec) {
  constexpr size_t kPieceBytes = 16 << 10;
  alignas(64) uint8_t piece[kPieceBytes];
  const size_t es = elementSize(spec.type);
  const size_t perPiece = kPieceBytes / es;
  SourcesAt sources(srcs, nsrc);
  for (size_t begin = 0; begin < count; begin += perPiece) {
    const size_t n = std::min(perPiece, count - begin);
    fn(piece, sources.at(begin * es), nsrc, n, spec);  // fn itself always stores plainly
    copyStreaming(static_cast<uint8_t*>(dst) + begin * es, piece, n * es);  // fenced
  }
}

// One ISA's reduction, streamed where asked unless dst is a source (reduce()'s contract).
void reduceUsing(ReduceFn fn, void* dst, const void* const* srcs, int nsrc, size_t count,
                 const ReduceSpec& spec) {
  if (spec.streaming && std::find(srcs, srcs + nsrc, dst) == srcs + nsrc) {
    return reduceStreaming(fn, dst, srcs, nsrc, count, spec);
  }
  fn(dst, srcs, nsrc, count, spec);
}

}  // namespace

Isa activeIsa() {
  static const Isa isa = chooseIsa();
  return isa;
}

void reduce(void* dst, const void* const* srcs, int nsrc, size_t count, const ReduceSpec& spec) {
  static const ReduceFn fn = functionFor(activeIsa());
  reduceUsing(fn, dst, srcs, nsrc, count, spec);
}

void reduceWith(Isa isa, void* dst, const void* const* srcs, int nsrc, size_t count,
                const ReduceSpec& spec) {
  reduceUsing(functionFor(isa), dst, srcs, nsrc, count, spec);
}

}  // namespace loom::kernels
