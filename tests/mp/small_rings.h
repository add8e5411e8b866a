#pragma once

// What the point-to-point suites share: ranks whose send/recv rings and collective slots are
// 16 KiB, so that modest messages already take many turns of a ring.

#include <gtest/gtest.h>

#include <functional>

#include "../common/forked_ranks.h"

namespace loom::testing {

/// Run options with 16 KiB rings and slots.
inline RunOptions smallRings() {
  RunOptions o;
  o.environment = {"LOOM_P2P_RING_BYTES=16K", "LOOM_CHUNK_BYTES=16K"};
  return o;
}

/// Runs `body` on `size` forked ranks with smallRings(), expecting every rank to succeed.
inline void expectOkOnSmallRings(int size, const std::function<void(RankContext&)>& body) {
  const auto outcomes = runRanks(size, body, smallRings());
  EXPECT_TRUE(failures(outcomes).empty()) << failures(outcomes);
}

}  // namespace loom::testing
