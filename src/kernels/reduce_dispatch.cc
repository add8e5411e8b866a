// Picks the reduction kernels for this CPU once, at first use.

#include <cstdlib>
#include <string>

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

}  // namespace

Isa activeIsa() {
  static const Isa isa = chooseIsa();
  return isa;
}

void reduce(void* dst, const void* const* srcs, int nsrc, size_t count, const ReduceSpec& spec) {
  static const ReduceFn fn = functionFor(activeIsa());
  fn(dst, srcs, nsrc, count, spec);
}

void reduceWith(Isa isa, void* dst, const void* const* srcs, int nsrc, size_t count,
                const ReduceSpec& spec) {
  functionFor(isa)(dst, srcs, nsrc, count, spec);
}

}  // namespace loom::kernels
