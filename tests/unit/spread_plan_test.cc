// The spread copy's plan, checked on the host: walking every block of every launch the way
// loom_copy_spread does (with the same helpers) covers every byte of every piece exactly once,
// with vector-aligned runs inside aligned pieces; large pieces go to the driver, empty ones
// nowhere, and launches hold at most kMaxSpreadPieces pieces.

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <vector>

#include "cuda/spread_plan.h"

namespace loom::cuda {
namespace {

// A piece at a made-up address (nothing is read or written): `misaligned` moves both ends off
// a 16-byte boundary.
Segment piece(uint64_t bytes, uint64_t index, bool misaligned = false) {
  const uintptr_t base = (uintptr_t{1} << 40) + index * (uintptr_t{1} << 24) + (misaligned ? 3 : 0);
  return {reinterpret_cast<void*>(base), reinterpret_cast<const void*>(base + (uintptr_t{1} << 39)),
          bytes};
}

// How many times each byte of each piece (by its dst address) the launches copy, walking
// every block as the kernel does.
std::map<const void*, std::vector<int>> coverage(const std::vector<SpreadLaunch>& launches) {
  std::map<const void*, std::vector<int>> seen;
  for (const SpreadLaunch& launch : launches) {
    const SpreadParams& p = launch.params;
    EXPECT_GT(p.count, 0);
    EXPECT_LE(p.count, kMaxSpreadPieces);
    EXPECT_EQ(p.perBlock % 16, 0u);
    const uint64_t total = p.starts[p.count - 1] + p.pieces[p.count - 1].bytes;
    EXPECT_GE(launch.blocks * p.perBlock, total) << "the blocks leave bytes out";
    EXPECT_LT((launch.blocks - 1) * p.perBlock, total) << "a block with nothing to do";
    for (int i = 0; i < p.count; ++i) {
      EXPECT_EQ(p.starts[i] % 16, 0u);
      if (i > 0) {
        EXPECT_GE(p.starts[i], p.starts[i - 1] + p.pieces[i - 1].bytes);
      }
      seen[p.pieces[i].dst].resize(p.pieces[i].bytes);
    }
    for (unsigned block = 0; block < launch.blocks; ++block) {
      const uint64_t begin = block * p.perBlock;
      const uint64_t end = begin + p.perBlock;
      for (int i = firstSpreadPiece(p, begin); i < p.count && p.starts[i] < end; ++i) {
        uint64_t from = 0;
        uint64_t to = 0;
        if (!spreadSlice(p, i, begin, end, &from, &to)) continue;
        const auto address = reinterpret_cast<uintptr_t>(p.pieces[i].dst);
        if (address % 16 == 0) {
          EXPECT_EQ(from % 16, 0u) << "a vector run starts mid-vector";
        }
        std::vector<int>& bytes = seen[p.pieces[i].dst];
        for (uint64_t b = from; b < to; ++b) ++bytes[b];
      }
    }
  }
  return seen;
}

void expectEachByteOnce(const std::vector<Segment>& copied,
                        const std::map<const void*, std::vector<int>>& seen) {
  ASSERT_EQ(seen.size(), copied.size());
  for (const Segment& s : copied) {
    const auto it = seen.find(s.dst);
    ASSERT_NE(it, seen.end());
    for (uint64_t b = 0; b < s.bytes; ++b) {
      ASSERT_EQ(it->second[b], 1) << "byte " << b << " of a piece of " << s.bytes;
    }
  }
}

TEST(SpreadPlan, EveryByteOfPiecesOfMixedSizesIsCopiedOnce) {
  std::vector<Segment> pieces;
  const uint64_t sizes[] = {1, 15, 16, 17, 4095, 65536, 65537, 100, 3 << 20, 70001};
  for (uint64_t i = 0; i < 40; ++i) pieces.push_back(piece(sizes[i % 10], i, i % 3 == 0));
  std::vector<Segment> alone;
  const auto launches = planSpread(pieces, uint64_t{1} << 40, 132, alone);
  EXPECT_TRUE(alone.empty());
  ASSERT_EQ(launches.size(), 1u);
  EXPECT_EQ(launches[0].params.count, 40);
  EXPECT_GT(launches[0].blocks, 100u);  // 30 MB over 64 KiB runs: many blocks
  expectEachByteOnce(pieces, coverage(launches));
}

TEST(SpreadPlan, LargePiecesGoToTheDriverEmptyOnesNowhere) {
  const std::vector<Segment> pieces = {
      piece(10, 0), piece(0, 1), piece(8 << 20, 2), piece(7, 3), piece((8 << 20) + 1, 4),
      piece(0, 5)};
  std::vector<Segment> alone;
  const auto launches = planSpread(pieces, 8 << 20, 132, alone);
  ASSERT_EQ(alone.size(), 2u);
  EXPECT_EQ(alone[0].dst, pieces[2].dst);
  EXPECT_EQ(alone[1].dst, pieces[4].dst);
  ASSERT_EQ(launches.size(), 1u);
  EXPECT_EQ(launches[0].params.count, 2);
  EXPECT_EQ(launches[0].blocks, 1u);  // 32 bytes: one block
  expectEachByteOnce({pieces[0], pieces[3]}, coverage(launches));
}

TEST(SpreadPlan, ManyPiecesSpreadOverSeveralLaunches) {
  std::vector<Segment> pieces;
  for (uint64_t i = 0; i < 2 * kMaxSpreadPieces + 7; ++i)
    pieces.push_back(piece(1000 + i, i, i % 2));
  std::vector<Segment> alone;
  const auto launches = planSpread(pieces, 8 << 20, 4, alone);
  ASSERT_EQ(launches.size(), 3u);
  EXPECT_EQ(launches[2].params.count, 7);
  for (const SpreadLaunch& launch : launches) EXPECT_LE(launch.blocks, 32u);  // 8 per SM
  expectEachByteOnce(pieces, coverage(launches));
}

TEST(SpreadPlan, NothingToCopyMeansNoLaunch) {
  std::vector<Segment> alone;
  EXPECT_TRUE(planSpread({}, 8 << 20, 132, alone).empty());
  const std::vector<Segment> empty = {piece(0, 0), piece(0, 1)};
  EXPECT_TRUE(planSpread(empty, 8 << 20, 132, alone).empty());
  EXPECT_TRUE(alone.empty());
}

}  // namespace
}  // namespace loom::cuda
