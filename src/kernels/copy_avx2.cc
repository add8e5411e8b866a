// Non-temporal copy with AVX2 (built with -mavx2; called only where the CPU has it).

#include "kernels/copy_impl.h"

namespace {

struct Lane {
  static constexpr size_t kBytes = 32;
  static __m256i load(const uint8_t* src) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  }
  static void stream(uint8_t* dst, __m256i v) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), v);
  }
};

}  // namespace

namespace loom::kernels {

void copyStreamingAvx2(void* dst, const void* src, size_t n) {
  streamWith<Lane>(dst, src, n);
}

}  // namespace loom::kernels
