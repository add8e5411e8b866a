// HostMap: which ranks share a host, as every rank derives it from the roster.

#include <gtest/gtest.h>

#include <vector>

#include "core/topology.h"

namespace loom {
namespace {

HostId host(uint8_t n) {
  HostId id{};
  id[0] = n;
  return id;
}

TEST(HostMap, NumbersHostsByTheirLowestRankAndListsRanksInOrder) {
  // Ranks 0..5 on hosts B A B C A B: B holds rank 0, so it is host 0.
  const std::vector<HostId> ids = {host(2), host(1), host(2), host(3), host(1), host(2)};
  const HostMap map(ids);
  ASSERT_EQ(map.hosts(), 3);
  EXPECT_EQ(map.ranksOn(0), (std::vector<int>{0, 2, 5}));
  EXPECT_EQ(map.ranksOn(1), (std::vector<int>{1, 4}));
  EXPECT_EQ(map.ranksOn(2), (std::vector<int>{3}));
  EXPECT_EQ(map.hostOf(4), 1);
  EXPECT_EQ(map.localIndex(5), 2);
  EXPECT_EQ(map.localIndex(4), 1);
  EXPECT_EQ(map.localRanks(3), 1);
  EXPECT_EQ(map.localRanks(2), 3);
}

TEST(HostMap, ChoosesTheLinkPerPair) {
  const std::vector<HostId> ids = {host(1), host(1), host(2)};
  const HostMap map(ids);
  EXPECT_EQ(map.link(0, 0), Link::kSelf);
  EXPECT_EQ(map.link(0, 1), Link::kSharedMemory);
  EXPECT_EQ(map.link(1, 2), Link::kNetwork);
  EXPECT_EQ(map.link(2, 0), Link::kNetwork);
}

TEST(HostMap, OneHostHoldsEveryRank) {
  const std::vector<HostId> ids(4, host(7));
  const HostMap map(ids);
  EXPECT_EQ(map.hosts(), 1);
  EXPECT_EQ(map.localRanks(0), 4);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(map.localIndex(r), r);
}

}  // namespace
}  // namespace loom
