// Non-temporal copy with AVX-512 (built with -mavx512f; called only where the CPU has it).
// One vector is one cache line, so every streaming store writes a whole line.

#include "kernels/copy_impl.h"

namespace {

struct Lane {
  static constexpr size_t kBytes = 64;
  static __m512i load(const uint8_t* src) { return _mm512_loadu_si512(src); }
  static void stream(uint8_t* dst, __m512i v) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
  }
};

}  // namespace

namespace loom::kernels {

void copyStreamingAvx512(void* dst, const void* src, size_t n) {
  streamWith<Lane>(dst, src, n);
}

}  // namespace loom::kernels
