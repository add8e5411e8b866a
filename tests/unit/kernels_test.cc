// The reduction kernels of every instruction set against the reference, and the 16-bit
// float conversions against known bit patterns.

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "../common/reference.h"
#include "kernels/copy.h"
#include "kernels/half.h"
#include "kernels/reduce.h"

namespace loom {
namespace {

using testing::fillInput;
using testing::firstDifference;
using testing::referenceReduce;

TEST(HalfConversion, KnownFp16Values) {
  EXPECT_EQ(kernels::floatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(kernels::floatToFp16(-2.0f), 0xc000);
  EXPECT_EQ(kernels::floatToFp16(65504.0f), 0x7bff);            // largest finite
  EXPECT_EQ(kernels::floatToFp16(65520.0f), 0x7c00);            // rounds to infinity
  EXPECT_EQ(kernels::floatToFp16(5.9604645e-8f), 0x0001);       // smallest subnormal
  EXPECT_EQ(kernels::floatToFp16(2.9802322e-8f), 0x0000);       // half of it: ties to even (0)
  EXPECT_EQ(kernels::floatToFp16(8.940697e-8f), 0x0002);        // 1.5 ulp: ties to even (2)
  EXPECT_EQ(kernels::floatToFp16(1.0f + 1.0f / 2048), 0x3c00);  // tie, even stays
  EXPECT_EQ(kernels::floatToFp16(1.0f + 3.0f / 2048), 0x3c02);  // tie, rounds up to even
  EXPECT_EQ(kernels::floatToFp16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(kernels::floatToFp16(std::nanf("")) & 0x7e00, 0x7e00);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    const float f = kernels::fp16ToFloat(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(kernels::floatToFp16(f), bits) << "round trip of 0x" << std::hex << h;
  }
}

TEST(HalfConversion, KnownBf16Values) {
  EXPECT_EQ(kernels::floatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(kernels::floatToBf16(-2.0f), 0xc000);
  EXPECT_EQ(kernels::floatToBf16(1.0f + 1.0f / 256), 0x3f80);  // tie: stays even
  EXPECT_EQ(kernels::floatToBf16(1.0f + 3.0f / 256), 0x3f82);  // tie: rounds up to even
  EXPECT_EQ(kernels::floatToBf16(std::nanf("")), 0x7fc0);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const auto bits = static_cast<uint16_t>(h);
    const float f = kernels::bf16ToFloat(bits);
    if (std::isnan(f)) continue;
    ASSERT_EQ(kernels::floatToBf16(f), bits) << "round trip of 0x" << std::hex << h;
  }
}

// Every ISA x type x reduction x source count x length (including lengths that are not a
// multiple of any vector width, and one longer than the kernels' block) matches the
// reference bit for bit.
TEST(ReduceKernels, EveryIsaMatchesReference) {
  for (kernels::Isa isa : {kernels::Isa::kPortable, kernels::Isa::kAvx2, kernels::Isa::kAvx512}) {
    if (!kernels::isaAvailable(isa)) continue;
    SCOPED_TRACE(std::string(kernels::isaName(isa)));
    for (DataType type : testing::allTypes()) {
      for (ReduceOp op : testing::reductionsFor(type)) {
        for (int nsrc : {1, 2, 3, 8}) {
          for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{33}, size_t{1029}}) {
            const uint32_t salt = static_cast<uint32_t>(count * 131 + nsrc);
            std::vector<std::vector<uint8_t>> inputs;
            std::vector<const void*> srcs;
            for (int r = 0; r < nsrc; ++r) {
              inputs.push_back(testing::inputBytes(type, count, r, salt));
            }
            for (auto& in : inputs) srcs.push_back(in.data());
            std::vector<uint8_t> out(count * elementSize(type) + 1);
            kernels::reduceWith(isa, out.data(), srcs.data(), nsrc, count, {type, op, nsrc});
            const auto want = referenceReduce(type, op, count, nsrc, salt);
            ASSERT_EQ(firstDifference(out.data(), want.data(), type, count), "")
                << dataTypeName(type) << " " << reduceKindName(op.kind()) << " nsrc=" << nsrc;
          }
        }
      }
    }
  }
}

// The destination may be the first source (in-place accumulation).
TEST(ReduceKernels, DestinationMayBeFirstSource) {
  const size_t count = 1000;
  auto a = testing::inputBytes(DataType::kFloat32, count, 0, 9);
  const auto b = testing::inputBytes(DataType::kFloat32, count, 1, 9);
  const void* srcs[] = {a.data(), b.data()};
  kernels::reduce(a.data(), srcs, 2, count, {DataType::kFloat32, ReduceKind::kSum, 2});
  const auto want = referenceReduce(DataType::kFloat32, ReduceKind::kSum, count, 2, 9);
  EXPECT_EQ(firstDifference(a.data(), want.data(), DataType::kFloat32, count), "");
}

// Streaming stores (outputs too large for cache) write the same bits as plain ones: every
// ISA and type, outputs of several pieces with a ragged end, a destination off the cache
// line, the destination being the first source (which the kernel then stores plainly), and
// more sources than fit on the stack.
TEST(ReduceKernels, StreamingMatchesPlain) {
  for (kernels::Isa isa : {kernels::Isa::kPortable, kernels::Isa::kAvx2, kernels::Isa::kAvx512}) {
    if (!kernels::isaAvailable(isa)) continue;
    SCOPED_TRACE(std::string(kernels::isaName(isa)));
    for (DataType type : testing::allTypes()) {
      const ReduceOp op = testing::reductionsFor(type).front();
      const size_t es = elementSize(type);
      for (int nsrc : {1, 3, 70}) {
        for (size_t offset : {size_t{0}, size_t{1}}) {  // elements past a 64-byte boundary
          const size_t count = (40 << 10) / es + 13;    // three pieces and a bit
          const uint32_t salt = static_cast<uint32_t>(nsrc * 7 + offset);
          std::vector<std::vector<uint8_t>> inputs;
          std::vector<const void*> srcs;
          for (int r = 0; r < nsrc; ++r)
            inputs.push_back(testing::inputBytes(type, count, r, salt));
          for (auto& in : inputs) srcs.push_back(in.data());
          const kernels::ReduceSpec plain{type, op, nsrc};
          const kernels::ReduceSpec streaming{type, op, nsrc, true};
          std::vector<uint8_t> want(count * es);
          kernels::reduceWith(isa, want.data(), srcs.data(), nsrc, count, plain);
          alignas(64) static uint8_t out[(48 << 10) + 128];
          std::memset(out, 0xab, sizeof(out));
          uint8_t* dst = out + offset * es;
          kernels::reduceWith(isa, dst, srcs.data(), nsrc, count, streaming);
          ASSERT_EQ(firstDifference(dst, want.data(), type, count), "")
              << dataTypeName(type) << " nsrc=" << nsrc << " offset=" << offset;
          EXPECT_EQ(dst[count * es], 0xab) << "wrote past the end";
          // In place: the first source is the destination.
          std::vector<uint8_t> first = inputs[0];
          srcs[0] = first.data();
          kernels::reduceWith(isa, first.data(), srcs.data(), nsrc, count, streaming);
          ASSERT_EQ(firstDifference(first.data(), want.data(), type, count), "")
              << "in place, " << dataTypeName(type) << " nsrc=" << nsrc;
        }
      }
    }
  }
}

// MIN and MAX propagate NaN from either side, as torch.minimum/maximum do.
TEST(ReduceKernels, MinMaxPropagateNaN) {
  for (kernels::Isa isa : {kernels::Isa::kPortable, kernels::Isa::kAvx2, kernels::Isa::kAvx512}) {
    if (!kernels::isaAvailable(isa)) continue;
    std::vector<float> a(64, 1.0f);
    std::vector<float> b(64, 2.0f);
    a[3] = std::nanf("");
    b[40] = std::nanf("");
    const void* srcs[] = {a.data(), b.data()};
    for (ReduceKind kind : {ReduceKind::kMin, ReduceKind::kMax}) {
      std::vector<float> out(64);
      kernels::reduceWith(isa, out.data(), srcs, 2, 64, {DataType::kFloat32, kind, 2});
      EXPECT_TRUE(std::isnan(out[3])) << kernels::isaName(isa);
      EXPECT_TRUE(std::isnan(out[40])) << kernels::isaName(isa);
      EXPECT_EQ(out[0], kind == ReduceKind::kMin ? 1.0f : 2.0f);
    }
  }
}

// Bool bytes are truth values (nonzero true), as torch reads a bool view of other bytes:
// 2 and 1 are both true, so PRODUCT and MIN (logical and) give true, not 2 & 1 = 0; every
// result byte is 0 or 1.
TEST(ReduceKernels, BoolBytesAreTruthValues) {
  for (kernels::Isa isa : {kernels::Isa::kPortable, kernels::Isa::kAvx2, kernels::Isa::kAvx512}) {
    if (!kernels::isaAvailable(isa)) continue;
    const std::vector<uint8_t> a{2, 2, 0, 0, 255}, b{1, 0, 4, 0, 1};
    const void* srcs[] = {a.data(), b.data()};
    const auto reduce = [&](ReduceKind kind) {
      std::vector<uint8_t> out(a.size(), 7);
      kernels::reduceWith(isa, out.data(), srcs, 2, a.size(), {DataType::kBool, kind, 2});
      return out;
    };
    using V = std::vector<uint8_t>;
    for (ReduceKind kind : {ReduceKind::kProduct, ReduceKind::kMin, ReduceKind::kBitAnd}) {
      EXPECT_EQ(reduce(kind), (V{1, 0, 0, 0, 1})) << kernels::isaName(isa);
    }
    for (ReduceKind kind : {ReduceKind::kSum, ReduceKind::kMax, ReduceKind::kBitOr}) {
      EXPECT_EQ(reduce(kind), (V{1, 1, 1, 0, 1})) << kernels::isaName(isa);
    }
    EXPECT_EQ(reduce(ReduceKind::kBitXor), (V{0, 1, 1, 0, 0})) << kernels::isaName(isa);
  }
}

// MIN and MAX over +0 and -0 keep the first source's zero, as torch.minimum and Gloo do.
TEST(ReduceKernels, MinMaxKeepTheFirstOfEqualValues) {
  for (kernels::Isa isa : {kernels::Isa::kPortable, kernels::Isa::kAvx2, kernels::Isa::kAvx512}) {
    if (!kernels::isaAvailable(isa)) continue;
    const std::vector<float> plus(64, 0.0f), minus(64, -0.0f);
    for (ReduceKind kind : {ReduceKind::kMin, ReduceKind::kMax}) {
      for (const auto& [first, second] : {std::pair{&plus, &minus}, std::pair{&minus, &plus}}) {
        const void* srcs[] = {first->data(), second->data()};
        std::vector<float> out(64, 1.0f);
        kernels::reduceWith(isa, out.data(), srcs, 2, 64, {DataType::kFloat32, kind, 2});
        EXPECT_EQ(std::signbit(out[0]), std::signbit((*first)[0])) << kernels::isaName(isa);
      }
    }
  }
}

// Streaming copies equal memcpy for every alignment of source and destination and for
// lengths around the vector and unroll widths.
TEST(CopyKernels, StreamingCopyMatchesMemcpy) {
  std::vector<uint8_t> src(5000), dst(5000 + 128), want(5000 + 128);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  for (size_t dstShift : {0, 1, 31, 32, 63}) {
    for (size_t srcShift : {0, 3}) {
      for (size_t n : {0, 1, 63, 64, 65, 255, 256, 257, 1000, 4000}) {
        std::fill(dst.begin(), dst.end(), 0xee);
        std::fill(want.begin(), want.end(), 0xee);
        std::memcpy(want.data() + dstShift, src.data() + srcShift, n);
        kernels::copyStreaming(dst.data() + dstShift, src.data() + srcShift, n);
        ASSERT_EQ(dst, want) << "dst+" << dstShift << " src+" << srcShift << " n=" << n;
      }
    }
  }
}

TEST(ReduceKernels, ActiveIsaIsAvailable) {
  EXPECT_TRUE(kernels::isaAvailable(kernels::activeIsa()));
  EXPECT_TRUE(kernels::isaAvailable(kernels::Isa::kPortable));
}

}  // namespace
}  // namespace loom
