// AVX-512 kernels (built with -mavx512f -mavx512bw -mavx512vl; called only where the CPU
// has them).

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernels/half.h"

namespace {

void loadFp16(const uint16_t* src, float* dst, size_t n) {
  size_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j));
    _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(h));
  }
  for (; j < n; ++j) dst[j] = loom::kernels::fp16ToFloat(src[j]);
}

void storeFp16(const float* src, uint16_t* dst, size_t n) {
  size_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), h);
  }
  for (; j < n; ++j) dst[j] = loom::kernels::floatToFp16(src[j]);
}

}  // namespace

#include "kernels/reduce_impl.h"

namespace loom::kernels {

void reduceAvx512(void* dst, const void* const* srcs, int nsrc, size_t count,
                  const ReduceSpec& spec) {
  reduceAnyType(dst, srcs, nsrc, count, spec);
}

}  // namespace loom::kernels
