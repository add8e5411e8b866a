// The kernels' image embedded in the library (cuda/kernel_image.cc) is the fatbinary nvcc
// wrote, byte for byte, whole by its own header and aligned where the CUDA driver reads it.
// Plain C++: loading it needs a GPU (tests/cuda/check_cuda.py does that on a GPU host).

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <vector>

#include "cuda/kernel_image.h"

namespace loom::cuda {
namespace {

template <typename T>
T readAt(const unsigned char* bytes, size_t offset) {
  T value;
  std::memcpy(&value, bytes + offset, sizeof(T));
  return value;
}

TEST(KernelImage, IsTheFatbinaryNvccWroteWholeAndAligned) {
  std::ifstream file(LOOM_KERNEL_FATBIN, std::ios::binary);
  ASSERT_TRUE(file) << "cannot read " << LOOM_KERNEL_FATBIN;
  const std::vector<unsigned char> written{std::istreambuf_iterator<char>(file), {}};
  ASSERT_GE(written.size(), 16u);
  // A fatbinary's header: magic, version, header size, then the size of what follows it.
  EXPECT_EQ(readAt<uint32_t>(loom_kernel_image, 0), 0xBA55ED50u);
  const auto headerBytes = readAt<uint16_t>(loom_kernel_image, 6);
  const auto bodyBytes = readAt<uint64_t>(loom_kernel_image, 8);
  // The header's length first: the comparison below reads that much of the image.
  ASSERT_EQ(headerBytes + bodyBytes, written.size());
  EXPECT_EQ(std::memcmp(loom_kernel_image, written.data(), written.size()), 0);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(loom_kernel_image) % 64, 0u);
}

}  // namespace
}  // namespace loom::cuda
