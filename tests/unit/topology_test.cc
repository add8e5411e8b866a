// HostMap: which ranks share a host, as every rank derives it from the roster; and this
// process's own host identity.

#include <gtest/gtest.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <vector>

#include "core/topology.h"

namespace loom {
namespace {

HostId host(uint8_t n) {
  HostId id{};
  id[0] = n;
  return id;
}

// A process whose parent read its host identity, then entered a network namespace of its own
// (as the multi-host tests' ranks do): its identity is that namespace's, not the parent's,
// while its machine (the kernel) stays the same. It used to keep the parent's, cached.
TEST(LocalHost, AForkThatEntersAnotherNetworkNamespaceIsAnotherHost) {
  if (::geteuid() != 0) GTEST_SKIP() << "entering a new network namespace needs root";
  const HostInfo parent = localHost();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::unshare(CLONE_NEWNET) != 0) ::_exit(2);
    const HostInfo mine = localHost();
    ::_exit(mine.id != parent.id && mine.machine == parent.machine ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_NE(WEXITSTATUS(status), 2) << "unshare(CLONE_NEWNET) failed";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child kept its parent's host identity";
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
