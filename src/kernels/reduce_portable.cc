// Portable kernels: plain C++ that builds anywhere (x86-64 baseline, aarch64, ...).

#include <cstddef>
#include <cstdint>

#include "kernels/half.h"

namespace {

void loadFp16(const uint16_t* src, float* dst, size_t n) {
  for (size_t j = 0; j < n; ++j) dst[j] = loom::kernels::fp16ToFloat(src[j]);
}

void storeFp16(const float* src, uint16_t* dst, size_t n) {
  for (size_t j = 0; j < n; ++j) dst[j] = loom::kernels::floatToFp16(src[j]);
}

}  // namespace

#include "kernels/reduce_impl.h"

namespace loom::kernels {

void reducePortable(void* dst, const void* const* srcs, int nsrc, size_t count,
                    const ReduceSpec& spec) {
  reduceAnyType(dst, srcs, nsrc, count, spec);
}

}  // namespace loom::kernels
