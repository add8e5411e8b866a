// The fused kernels' slices and turns, checked on the host. Slices: in every step of a call,
// the blocks' slices cover the step's elements exactly once, evenly, and each block's slice
// lies inside the one it has in the call's first step, so a block never writes region bytes
// that another block of the receiver frees (found on four H200s: a short last step's
// slices, cut from its own size, corrupted all_gather and reduce_scatter of 3M floats).
// The chain's links, the ring all_reduce's schedule and the fused transfer's pieces, the
// same way.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/kernel_params.h"

namespace loom::cuda {
namespace {

void checkCall(uint64_t count, uint64_t perStep, int blocks, uint64_t vector) {
  SCOPED_TRACE("count " + std::to_string(count) + ", perStep " + std::to_string(perStep) +
               ", blocks " + std::to_string(blocks) + ", vector " + std::to_string(vector));
  for (uint64_t lo = 0; lo < count || lo == 0; lo += perStep) {
    const uint64_t n = count - lo < perStep ? count - lo : perStep;
    uint64_t next = 0;  // slices come in block order, each starting where the last ended
    const uint64_t first = count < perStep ? count : perStep;
    for (int b = 0; b < blocks; ++b) {
      const FusedSlice s = fusedSlice(first, n, blocks, b, vector);
      const FusedSlice full = fusedSlice(first, first, blocks, b, vector);
      ASSERT_EQ(s.from, next) << "block " << b;
      ASSERT_LE(s.from, s.to);
      // Balanced: no block takes more than its even share of the first step, rounded up
      // to a vector (a call smaller than a step is not left to a few blocks).
      ASSERT_LE(s.to - s.from, (first + blocks - 1) / blocks + vector) << "block " << b;
      if (s.from < s.to) {
        ASSERT_GE(s.from, full.from) << "block " << b << " moved in a short step";
        ASSERT_LE(s.to, full.to) << "block " << b << " moved in a short step";
        ASSERT_EQ(s.from % vector, 0u) << "unaligned slice";
      }
      next = s.to;
    }
    ASSERT_EQ(next, n) << "the blocks leave elements out";
    if (count == 0) break;
  }
}

TEST(FusedSlice, EveryStepIsCoveredOnceAndSlicesStayPut) {
  // 3M floats at P = 4 with the default chunk: the case that failed on the GPUs.
  checkCall(3'000'000, (2 * (uint64_t{8} << 20) / 3) / 16 * 16 / 4, 64, 4);
  for (uint64_t vector : {1, 2, 4, 8, 16}) {
    for (int blocks : {1, 3, 42, 64}) {
      for (uint64_t perStep : {uint64_t{16}, uint64_t{1000}, uint64_t{65536}, uint64_t{1398100}}) {
        for (uint64_t count : {uint64_t{0}, uint64_t{1}, perStep - 1, perStep, 2 * perStep + 7,
                               5 * perStep + perStep / 3}) {
          checkCall(count, perStep, blocks, vector);
        }
      }
    }
  }
}

// A fused transfer's pieces: whatever a rank's blocks per stream (a power of two up to
// kTransferPieces), its blocks take every piece once, in order, and a block's bytes are
// exactly its pieces' bytes, which tile the chunk and lie where the other end, cutting the
// same chunk among another number of blocks, looks for them.
TEST(TransferPieces, EveryGridCutsTheSamePieces) {
  for (uint64_t slot : {uint64_t{8} << 20, uint64_t{256} << 10, uint64_t{4096}, uint64_t{1008}}) {
    for (uint64_t n : {uint64_t{0}, uint64_t{1}, uint64_t{17}, slot / 3, slot - 1, slot}) {
      SCOPED_TRACE("slot " + std::to_string(slot) + ", n " + std::to_string(n));
      for (int blocks = 1; blocks <= kTransferPieces; blocks *= 2) {
        int nextPiece = 0;
        uint64_t nextByte = 0;
        for (int b = 0; b < blocks; ++b) {
          const TransferPieces s = transferPieces(slot, blocks, b, n);
          ASSERT_EQ(s.first, nextPiece) << "blocks " << blocks << " block " << b;
          ASSERT_GT(s.count, 0);
          ASSERT_EQ(s.from, nextByte) << "blocks " << blocks << " block " << b;
          for (int k = 0; k < s.count; ++k) {
            const FusedSlice piece = fusedSlice(slot, n, kTransferPieces, s.first + k, 16);
            ASSERT_EQ(piece.from, nextByte) << "piece " << s.first + k;
            nextByte = piece.to;
          }
          ASSERT_EQ(s.to, nextByte) << "blocks " << blocks << " block " << b;
          nextPiece += s.count;
        }
        ASSERT_EQ(nextPiece, kTransferPieces) << "blocks " << blocks;
        ASSERT_EQ(nextByte, n) << "blocks " << blocks;
      }
    }
  }
}

// The turns of the fused kernels' pushes: a block visits every peer once per step, never
// itself, and at each turn the ranks' same blocks send to distinct peers (no peer receives
// from two at once), while one rank's blocks start at different peers.
TEST(FusedPeerInTurn, EveryPeerOncePerStepAndNoTwoRanksOnOnePeer) {
  for (int size = 2; size <= kMaxSources; ++size) {
    for (int block = 0; block < kMaxFusedBlocks; ++block) {
      for (int rank = 0; rank < size; ++rank) {
        std::vector<int> visits(static_cast<size_t>(size), 0);
        for (int k = 0; k < size - 1; ++k) {
          const int q = fusedPeerInTurn(rank, size, block, k);
          ASSERT_GE(q, 0);
          ASSERT_LT(q, size);
          ASSERT_NE(q, rank) << "size " << size << " block " << block << " turn " << k;
          ++visits[static_cast<size_t>(q)];
        }
        for (int q = 0; q < size; ++q) EXPECT_EQ(visits[static_cast<size_t>(q)], q == rank ? 0 : 1);
      }
      for (int k = 0; k < size - 1; ++k) {
        std::vector<int> receivers(static_cast<size_t>(size), 0);
        for (int rank = 0; rank < size; ++rank) {
          ++receivers[static_cast<size_t>(fusedPeerInTurn(rank, size, block, k))];
        }
        for (int q = 0; q < size; ++q) {
          ASSERT_EQ(receivers[static_cast<size_t>(q)], 1)
              << "size " << size << " block " << block << " turn " << k << ": peer " << q;
        }
      }
    }
    if (size > 2) {
      EXPECT_NE(fusedPeerInTurn(0, size, 0, 0), fusedPeerInTurn(0, size, 1, 0));
    }
  }
}

// Two-shot shares: all_reduce gives every rank one, broadcast every rank but the root, in
// rank order, each in a place of its own inside the step.
TEST(TwoShotShares, OnePlacePerOwner) {
  for (int size = 3; size <= kMaxSources; ++size) {
    for (int root = -1; root < size; ++root) {
      const int shares = twoShotShares(size, root);
      ASSERT_EQ(shares, root < 0 ? size : size - 1);
      std::vector<int> used(static_cast<size_t>(shares), 0);
      for (int q = 0; q < size; ++q) {
        if (q == root) continue;
        const int at = twoShotShareIndex(q, root);
        ASSERT_GE(at, 0);
        ASSERT_LT(at, shares) << "size " << size << " root " << root << " owner " << q;
        ++used[static_cast<size_t>(at)];
      }
      for (int at = 0; at < shares; ++at) EXPECT_EQ(used[static_cast<size_t>(at)], 1);
    }
  }
}

// A fused grid of roles x blocks: every (role, block) played by exactly one grid block, and
// each role's blocks spread over the grid (in every window of `roles` grid blocks, one each).
TEST(FusedRole, EveryRoleAndBlockOnceAndRolesTakeTurns) {
  for (int roles : {2, 3}) {
    for (int blocks = 1; blocks <= kMaxFusedBlocks; ++blocks) {
      std::vector<int> played(static_cast<size_t>(roles * blocks), 0);
      for (int i = 0; i < roles * blocks; ++i) {
        const int role = fusedRole(i, roles);
        const int block = fusedRoleBlock(i, roles);
        ASSERT_GE(role, 0);
        ASSERT_LT(role, roles);
        ASSERT_GE(block, 0);
        ASSERT_LT(block, blocks) << "roles " << roles << " blocks " << blocks << " index " << i;
        ++played[static_cast<size_t>(role * blocks + block)];
        EXPECT_EQ(role, i % roles);
      }
      for (int n : played) EXPECT_EQ(n, 1);
    }
  }
}

// A chained broadcast: from the root, following `next` visits every rank once and ends at
// the one rank with no successor; `prev` undoes `next`; only the root has no predecessor.
TEST(ChainLinks, FromTheRootThroughEveryRankOnce) {
  for (int size = 2; size <= kMaxSources; ++size) {
    for (int root = 0; root < size; ++root) {
      EXPECT_EQ(chainLinks(root, size, root).prev, -1);
      std::vector<int> visited(static_cast<size_t>(size), 0);
      int at = root;
      for (int hops = 0; at >= 0; ++hops) {
        ASSERT_LT(hops, size) << "size " << size << " root " << root;
        ++visited[static_cast<size_t>(at)];
        const int next = chainLinks(at, size, root).next;
        if (next >= 0) {
          EXPECT_EQ(chainLinks(next, size, root).prev, at);
        }
        at = next;
      }
      for (int n : visited) EXPECT_EQ(n, 1);
      for (int rank = 0; rank < size; ++rank) {
        if (rank != root) {
          EXPECT_GE(chainLinks(rank, size, root).prev, 0);
        }
      }
    }
  }
}

// A ring all_reduce (FusedParams::chain, root < 0), run on the host in the kernel's order of
// passes and hops: in place (one array per rank is input and output, as an in-place call),
// each hop through a slot of its own, integer sums, so every rank must end with the exact
// total in every element, and no rank may overwrite an element of its input before its last
// read of it. Shares at the end of a step may be short or empty.
void checkRing(int size, uint64_t count, uint64_t share) {
  SCOPED_TRACE("size " + std::to_string(size) + ", count " + std::to_string(count) + ", share " +
               std::to_string(share));
  const uint64_t perStep = share * static_cast<uint64_t>(size);
  const uint64_t steps = count == 0 ? 1 : (count + perStep - 1) / perStep;
  const int hops = ringHops(size);
  std::vector<std::vector<int64_t>> data(static_cast<size_t>(size));
  std::vector<int64_t> want(count, 0);
  for (int r = 0; r < size; ++r) {
    for (uint64_t i = 0; i < count; ++i) {
      data[static_cast<size_t>(r)].push_back((r + 1) * 1'000'003 + static_cast<int64_t>(i) * 7);
      want[i] += data[static_cast<size_t>(r)].back();
    }
  }
  // slots[r][hop]: what the rank before r sent as hop `hop` of the current step.
  std::vector<std::vector<std::vector<int64_t>>> slots(
      static_cast<size_t>(size), std::vector<std::vector<int64_t>>(static_cast<size_t>(hops)));
  for (uint64_t step = 0; step < steps; ++step) {
    const uint64_t lo = step * perStep;
    const uint64_t n = count - lo < perStep ? count - lo : perStep;
    for (int pass = 0; pass <= hops; ++pass) {
      for (int r = 0; r < size; ++r) {
        const int next = (r + 1) % size;
        const uint64_t start = static_cast<uint64_t>(ringShare(r, size, pass)) * share;
        const uint64_t first = start < n ? start : n;
        const uint64_t last = first + share < n ? first + share : n;
        std::vector<int64_t>& mine = data[static_cast<size_t>(r)];
        const std::vector<int64_t>* incoming =
            pass > 0 ? &slots[static_cast<size_t>(r)][static_cast<size_t>(pass - 1)] : nullptr;
        if (incoming != nullptr) {
          ASSERT_EQ(incoming->size(), last - first) << "rank " << r;
        }
        std::vector<int64_t> result(last - first);
        for (uint64_t i = 0; i < last - first; ++i) {
          const int64_t in = incoming != nullptr ? (*incoming)[i] : 0;
          result[i] = pass < size ? in + mine[lo + first + i] : in;
        }
        if (pass >= size - 1) {
          for (uint64_t i = 0; i < last - first; ++i) mine[lo + first + i] = result[i];
        }
        if (pass < hops) {
          slots[static_cast<size_t>(next)][static_cast<size_t>(pass)] = std::move(result);
        }
      }
    }
  }
  for (int r = 0; r < size; ++r) {
    ASSERT_EQ(data[static_cast<size_t>(r)], want) << "rank " << r;
  }
}

TEST(RingAllReduce, EveryRankEndsWithTheTotalInPlace) {
  for (int size = 2; size <= kMaxSources; ++size) {
    for (uint64_t share : {uint64_t{4}, uint64_t{64}}) {
      const uint64_t perStep = share * static_cast<uint64_t>(size);
      for (uint64_t count :
           {uint64_t{0}, uint64_t{1}, share + 3, perStep - 1, perStep, 3 * perStep + share / 2}) {
        checkRing(size, count, share);
      }
    }
  }
}

TEST(RingAllReduce, EachPassTakesWhatTheRankBeforeSent) {
  for (int size = 2; size <= kMaxSources; ++size) {
    for (int rank = 0; rank < size; ++rank) {
      const int prev = (rank + size - 1) % size;
      std::vector<int> reduced(static_cast<size_t>(size), 0);
      std::vector<int> written(static_cast<size_t>(size), 0);
      for (int pass = 0; pass <= ringHops(size); ++pass) {
        const int share = ringShare(rank, size, pass);
        if (pass > 0) {
          EXPECT_EQ(share, ringShare(prev, size, pass - 1));
        }
        if (pass < size) ++reduced[static_cast<size_t>(share)];
        if (pass >= size - 1) ++written[static_cast<size_t>(share)];
      }
      // Every share gets this rank's part once, and its finished value once.
      for (int q = 0; q < size; ++q) {
        EXPECT_EQ(reduced[static_cast<size_t>(q)], 1) << "size " << size << " rank " << rank;
        EXPECT_EQ(written[static_cast<size_t>(q)], 1) << "size " << size << " rank " << rank;
      }
    }
  }
}

// Ranks that spin together on one GPU (forced fused kernels under MPS) take a share each of
// the blocks it keeps resident, so that all their grids are placed at once; with a GPU per
// rank the limits are the configured ones, as before shares existed.
TEST(FusedGridShare, EveryRanksGridsFitOnTheirGpuTogether) {
  for (int resident : {66, 132, 264, 528, 1056, 4224}) {
    for (int crowd = 1; crowd <= kMaxSources; ++crowd) {
      const int share = fusedGridShare(resident, crowd);
      EXPECT_LE(share, 2 * kMaxFusedBlocks);
      if (share < 3) continue;  // no fused call there
      for (int configured : {1, 7, 16, 64}) {
        const int pairs = fusedBlocksWithin(share, configured);
        const int twoShot = twoShotBlocksWithin(share, pairs);
        SCOPED_TRACE(std::to_string(resident) + " resident, " + std::to_string(crowd) + " ranks, " +
                     std::to_string(configured) + " configured");
        EXPECT_GE(pairs, 1);
        EXPECT_GE(twoShot, 1);
        EXPECT_LE(pairs, configured);
        EXPECT_LE(crowd * 2 * pairs, resident);    // one-shot, copies, transfers
        EXPECT_LE(crowd * 3 * twoShot, resident);  // two shots: three roles
        if (crowd == 1 && resident >= 2 * kMaxFusedBlocks) {
          EXPECT_EQ(pairs, configured);
          EXPECT_EQ(twoShot, std::min(configured, kMaxTwoShotBlocks));
        }
      }
    }
  }
  EXPECT_EQ(fusedGridShare(264, 4), 66);
  EXPECT_EQ(fusedGridShare(132, 64), 2);  // too few for any fused call
}

}  // namespace
}  // namespace loom::cuda
