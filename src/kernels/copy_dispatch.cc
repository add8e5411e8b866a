// Picks the streaming copy for this CPU.

#include <unistd.h>

#include <cstring>

#include "kernels/copy.h"
#include "kernels/reduce.h"

namespace loom::kernels {

#if defined(LOOM_HAVE_X86_KERNELS)
void copyStreamingAvx2(void* dst, const void* src, size_t n);
void copyStreamingAvx512(void* dst, const void* src, size_t n);
#endif

namespace {

using CopyFn = void (*)(void*, const void*, size_t);

void copyPlain(void* dst, const void* src, size_t n) {
  std::memcpy(dst, src, n);
}

CopyFn chooseCopy() {
#if defined(LOOM_HAVE_X86_KERNELS)
  switch (activeIsa()) {
    case Isa::kAvx512: return copyStreamingAvx512;
    case Isa::kAvx2: return copyStreamingAvx2;
    default: break;
  }
#endif
  return copyPlain;
}

}  // namespace

void copyStreaming(void* dst, const void* src, size_t n) {
  static const CopyFn fn = chooseCopy();
  fn(dst, src, n);
}

size_t lastLevelCacheBytes() {
  static const size_t bytes = [] {
#ifdef _SC_LEVEL3_CACHE_SIZE
    const long l3 = ::sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l3 > 0) return static_cast<size_t>(l3);
#endif
    return size_t{32} << 20;
  }();
  return bytes;
}

}  // namespace loom::kernels
