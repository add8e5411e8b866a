// choosePlacement: which CPUs each rank of a host keeps to, and when loom leaves them alone.

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "core/bootstrap.h"
#include "core/placement.h"
#include "core/topology.h"

namespace loom {
namespace {

// A roster of `hostOf.size()` ranks, each its own process, all given `cpus`.
Roster rosterOf(const std::vector<uint8_t>& hostOf, const std::vector<int>& cpus) {
  Roster roster;
  for (size_t r = 0; r < hostOf.size(); ++r) {
    PeerInfo peer;
    peer.host[0] = hostOf[r];
    peer.pid = 100 + static_cast<int32_t>(r);
    peer.cpus = cpuFingerprint(cpus);
    roster.peers.push_back(peer);
  }
  return roster;
}

HostMap mapOf(const Roster& roster) {
  return hostMapOf(roster);
}

std::vector<int> range(int first, int count) {
  std::vector<int> v(static_cast<size_t>(count));
  std::iota(v.begin(), v.end(), first);
  return v;
}

TEST(Placement, GivesEachRankOfAHostItsOwnBlock) {
  const std::vector<int> cpus = range(0, 16);
  const Roster roster = rosterOf({0, 0, 0, 0}, cpus);
  for (int r = 0; r < 4; ++r) {
    const Placement p = choosePlacement(roster, mapOf(roster), r, cpus, 4);
    EXPECT_EQ(p.cpus, range(4 * r, 4)) << p.reason;
  }
}

TEST(Placement, SplitsTheCpusTheRanksShareNotTheMachine) {
  // Every rank was started on CPUs 8..15 (numactl, a container's cpuset): blocks of those.
  const std::vector<int> cpus = range(8, 8);
  const Roster roster = rosterOf({0, 0}, cpus);
  EXPECT_EQ(choosePlacement(roster, mapOf(roster), 0, cpus, 2).cpus, range(8, 4));
  EXPECT_EQ(choosePlacement(roster, mapOf(roster), 1, cpus, 2).cpus, range(12, 4));
}

TEST(Placement, LeavesAlonePlacedRanksThreadsAndSmallBlocks) {
  const std::vector<int> cpus = range(0, 16);
  Roster placed = rosterOf({0, 0}, cpus);
  placed.peers[1].cpus = cpuFingerprint(range(8, 8));  // a launcher placed rank 1
  EXPECT_TRUE(choosePlacement(placed, mapOf(placed), 0, cpus, 2).cpus.empty());

  Roster threads = rosterOf({0, 0}, cpus);
  threads.peers[1].pid = threads.peers[0].pid;  // ranks as threads of one process
  const Placement t = choosePlacement(threads, mapOf(threads), 1, cpus, 2);
  EXPECT_TRUE(t.cpus.empty());
  EXPECT_NE(t.reason.find("threads of one process"), std::string::npos) << t.reason;

  const Roster four = rosterOf({0, 0, 0, 0}, cpus);
  EXPECT_TRUE(choosePlacement(four, mapOf(four), 0, cpus, 8).cpus.empty());  // 4 CPUs < 8
  const Roster many = rosterOf(std::vector<uint8_t>(16, 0), cpus);
  EXPECT_EQ(choosePlacement(many, mapOf(many), 3, cpus, 1).cpus, range(3, 1));  // one CPU each
  const Roster crowded = rosterOf(std::vector<uint8_t>(17, 0), cpus);
  EXPECT_TRUE(choosePlacement(crowded, mapOf(crowded), 3, cpus, 1).cpus.empty());  // 16 < 17

  const Roster alone = rosterOf({0}, cpus);
  EXPECT_TRUE(choosePlacement(alone, mapOf(alone), 0, cpus, 4).cpus.empty());
}

TEST(Placement, LeavesRanksAloneWhenTheCommunicatorSpansHosts) {
  // Namespace hosts on one machine share its CPUs in a way no host map shows.
  const std::vector<int> cpus = range(0, 16);
  const Roster roster = rosterOf({0, 0, 1, 1}, cpus);
  const Placement p = choosePlacement(roster, mapOf(roster), 0, cpus, 2);
  EXPECT_TRUE(p.cpus.empty());
  EXPECT_NE(p.reason.find("spans hosts"), std::string::npos) << p.reason;
}

TEST(Placement, FingerprintsTellCpuSetsApart) {
  EXPECT_EQ(cpuFingerprint(range(0, 8)), cpuFingerprint(range(0, 8)));
  EXPECT_NE(cpuFingerprint(range(0, 8)), cpuFingerprint(range(8, 8)));
  EXPECT_NE(cpuFingerprint(range(0, 8)), cpuFingerprint(range(0, 7)));
}

}  // namespace
}  // namespace loom
