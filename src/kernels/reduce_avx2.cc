// AVX2 kernels (built with -mavx2 -mf16c; called only where the CPU has both).

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernels/half.h"

namespace {

void loadFp16(const uint16_t* src, float* dst, size_t n) {
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(h));
  }
  for (; j < n; ++j) dst[j] = loom::kernels::fp16ToFloat(src[j]);
}

void storeFp16(const float* src, uint16_t* dst, size_t n) {
  size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), h);
  }
  for (; j < n; ++j) dst[j] = loom::kernels::floatToFp16(src[j]);
}

}  // namespace

#include "kernels/reduce_impl.h"

namespace loom::kernels {

void reduceAvx2(void* dst, const void* const* srcs, int nsrc, size_t count,
                const ReduceSpec& spec) {
  reduceAnyType(dst, srcs, nsrc, count, spec);
}

}  // namespace loom::kernels
