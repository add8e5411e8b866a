// The schedules of the collectives across hosts (algorithms/schedule.h): every collective on
// layouts up to 16,384 ranks finishes under rendezvous sends with every message matched, and
// moves the bytes the cost model in docs/SCALING.md says (a large broadcast: each host's
// share once); and the checker itself catches a deadlock, a mismatched message and
// disagreeing local steps.

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "algorithms/schedule.h"

namespace loom {
namespace {

using Layout = std::vector<std::vector<int>>;

Layout hostsOf(int hosts, int perHost) {
  Layout layout(static_cast<size_t>(hosts));
  for (int r = 0; r < hosts * perHost; ++r) layout[r / perHost].push_back(r);
  return layout;
}

ScheduleReport simulate(const Layout& layout, const SimulatedOp& op) {
  return checkSchedules(layout, recordSchedules(layout, op));
}

SimulatedOp opOf(CollectiveKind kind, size_t count, int root = 0) {
  SimulatedOp op;
  op.kind = kind;
  op.count = count;
  op.root = root;
  return op;
}

TEST(Schedules, EveryCollectiveFinishesOnManyLayouts) {
  // Hosts of two or three ranks: two rails, so a small broadcast spreads over them.
  const Layout uneven = {{0, 1}, {2, 3, 4}, {5, 6}, {7, 8, 9}};
  const std::vector<Layout> layouts = {
      hostsOf(2, 1), hostsOf(2, 4),  hostsOf(3, 2),  hostsOf(4, 3),  hostsOf(6, 2),
      hostsOf(9, 1), hostsOf(12, 2), hostsOf(16, 2), hostsOf(33, 1), {{0, 3}, {1}, {2, 4, 5}},
      uneven};
  for (const Layout& layout : layouts) {
    const int size = [&] {
      int n = 0;
      for (const auto& h : layout) n += static_cast<int>(h.size());
      return n;
    }();
    for (int k = 1; k <= 9; ++k) {
      const auto kind = static_cast<CollectiveKind>(k);
      for (size_t count : {size_t{0}, size_t{10}, size_t{100000}}) {
        const ScheduleReport report = simulate(layout, opOf(kind, count, size - 1));
        EXPECT_EQ(report.error, "")
            << collectiveName(kind) << " count " << count << " on " << layout.size() << " hosts";
      }
    }
    SimulatedOp v = opOf(CollectiveKind::kAllGather, 0);
    for (int q = 0; q < size; ++q) v.counts.push_back(static_cast<size_t>(q % 3) * 40000);
    EXPECT_EQ(simulate(layout, v).error, "") << "all_gather_v";
    v.kind = CollectiveKind::kReduceScatter;
    EXPECT_EQ(simulate(layout, v).error, "") << "reduce_scatter_v";
  }
}

// Whether AddressSanitizer instruments this build.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kUnderAddressSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kUnderAddressSanitizer = true;
#else
constexpr bool kUnderAddressSanitizer = false;
#endif
#else
constexpr bool kUnderAddressSanitizer = false;
#endif

// all_reduce of N bytes over H hosts of R ranks: the rails carry (H - 1)/H of the buffer
// each way in total (2(H - 1)/H N per host), and each rail rank sends 1/R of that.
TEST(Schedules, AllReduceMovesTheBandwidthOptimalBytesUpTo16384Ranks) {
  struct Case {
    int hosts, perHost;
  };
  for (const Case c : {Case{4, 4}, Case{8, 8}, Case{64, 8}, Case{2048, 8}}) {
    // The 16,384-rank layout runs the 512-rank one's code at 32 times the scale: 150 s of
    // CI's 2-core machine under AddressSanitizer (10 s in the release build, which runs it).
    if (kUnderAddressSanitizer && c.hosts * c.perHost > 512) continue;
    const size_t count = size_t{1} << 19;  // 2 MiB of float32: one segment
    const size_t bytes = count * 4;
    const ScheduleReport report =
        simulate(hostsOf(c.hosts, c.perHost), opOf(CollectiveKind::kAllReduce, count));
    ASSERT_EQ(report.error, "") << c.hosts << " hosts";
    const double perHost = 2.0 * (c.hosts - 1) / c.hosts * static_cast<double>(bytes);
    EXPECT_NEAR(static_cast<double>(report.maxHostSentBytes), perHost, perHost * 0.01)
        << c.hosts << " hosts";
    EXPECT_NEAR(static_cast<double>(report.maxSentBytes), perHost / c.perHost,
                perHost / c.perHost * 0.01);
    // Recursive halving and doubling: 2 log2 H network steps for a buffer that goes in one
    // segment (larger ones repeat them per segment, to overlap with the local steps).
    EXPECT_EQ(report.maxNetworkSteps, static_cast<size_t>(2 * std::log2(c.hosts)));
  }
}

TEST(Schedules, TwoHostsAllReduceIsOneExchangePerRail) {
  const ScheduleReport report =
      simulate(hostsOf(2, 4), opOf(CollectiveKind::kAllReduce, size_t{1} << 19));  // 2 MiB
  ASSERT_EQ(report.error, "");
  EXPECT_EQ(report.maxNetworkSteps, 1u);
  EXPECT_EQ(report.maxSentBytes, (size_t{2} << 20) / 4);
}

// A large broadcast goes down a chain of hosts: each host sends the buffer once at most (a
// binomial scatter and an all-gather made the root's host send 2 (H - 1) / H of it).
TEST(Schedules, LargeBroadcastSendsTheBufferOncePerHost) {
  struct Case {
    int hosts, perHost;
  };
  for (const Case c : {Case{3, 1}, Case{4, 2}, Case{4, 4}, Case{8, 1}}) {
    const size_t count = size_t{4} << 20;  // 16 MiB of float32: four segments
    const ScheduleReport report =
        simulate(hostsOf(c.hosts, c.perHost), opOf(CollectiveKind::kBroadcast, count));
    ASSERT_EQ(report.error, "") << c.hosts << " hosts";
    EXPECT_EQ(report.maxHostSentBytes, count * 4) << c.hosts << " hosts";
  }
}

// A small broadcast spreads the other hosts over the rails, each rail taking the whole
// buffer to its group: no rank sends more than a binomial tree over its group asks, and
// with as many rails as other hosts every host has it after one network round.
TEST(Schedules, SmallBroadcastSpreadsTheHostsOverTheRails) {
  struct Case {
    int hosts, perHost;
    size_t steps;  // the most exchanges any rank takes: ceil(log2(g + 1)), g the largest group
  };
  for (const Case c : {Case{4, 2, 2}, Case{4, 4, 1}, Case{3, 2, 1}, Case{9, 2, 3}, Case{16, 8, 2},
                       Case{8, 1, 3}}) {
    const size_t count = 1000;  // 4000 bytes of float32: one rail's worth
    for (int root : {0, c.hosts * c.perHost - 1}) {
      const ScheduleReport report =
          simulate(hostsOf(c.hosts, c.perHost), opOf(CollectiveKind::kBroadcast, count, root));
      ASSERT_EQ(report.error, "") << c.hosts << " x " << c.perHost;
      EXPECT_EQ(report.maxNetworkSteps, c.steps) << c.hosts << " x " << c.perHost;
      // Every non-root host receives the buffer once.
      EXPECT_EQ(report.messages, static_cast<size_t>(c.hosts - 1)) << c.hosts << " x " << c.perHost;
    }
  }
  // The root's own rail takes the shortest group: on 4 hosts of 2 ranks the root sends once
  // (its neighbour on the root's host feeds a tree over the other two hosts), on 3 of 4 never.
  struct Sends {
    int hosts, perHost, root;
    size_t sends;
  };
  for (const Sends c : {Sends{4, 2, 0, 1}, Sends{4, 2, 1, 1}, Sends{3, 4, 3, 0}}) {
    const auto schedules = recordSchedules(hostsOf(c.hosts, c.perHost),
                                           opOf(CollectiveKind::kBroadcast, 1000, c.root));
    size_t sends = 0;
    for (const ScheduleStep& step : schedules[static_cast<size_t>(c.root)]) {
      sends += step.sends.size();
    }
    EXPECT_EQ(sends, c.sends) << c.hosts << " x " << c.perHost << " from " << c.root;
  }
}

TEST(Schedules, AllGatherAndReduceScatterSendTheirShareOnce) {
  const int hosts = 8, perHost = 4;
  const size_t perRank = 1 << 16;  // float32 elements
  for (CollectiveKind kind : {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter}) {
    const ScheduleReport report = simulate(hostsOf(hosts, perHost), opOf(kind, perRank));
    ASSERT_EQ(report.error, "") << collectiveName(kind);
    const double total = 4.0 * static_cast<double>(perRank) * hosts * perHost;
    const double perHostBytes = (hosts - 1.0) / hosts * total;
    EXPECT_NEAR(static_cast<double>(report.maxHostSentBytes), perHostBytes, perHostBytes * 0.01)
        << collectiveName(kind);
  }
}

// The checker catches what would hang or corrupt.
ScheduleStep exchangeStep(std::vector<ScheduledMessage> sends,
                          std::vector<ScheduledMessage> receives) {
  ScheduleStep step;
  step.sends = std::move(sends);
  step.receives = std::move(receives);
  return step;
}

TEST(ScheduleChecker, FindsADeadlock) {
  // Each rank waits to receive before it sends.
  const Layout layout = {{0}, {1}};
  const std::vector<Schedule> schedules = {
      {exchangeStep({}, {{1, 8, 0}}), exchangeStep({{1, 8, 0}}, {})},
      {exchangeStep({}, {{0, 8, 0}}), exchangeStep({{0, 8, 0}}, {})}};
  const ScheduleReport report = checkSchedules(layout, schedules);
  EXPECT_NE(report.error.find("deadlock"), std::string::npos) << report.error;
}

TEST(ScheduleChecker, FindsAMismatchedMessage) {
  const Layout layout = {{0}, {1}};
  const std::vector<Schedule> schedules = {{exchangeStep({{1, 8, 0}}, {})},
                                           {exchangeStep({}, {{0, 16, 0}})}};
  const ScheduleReport report = checkSchedules(layout, schedules);
  EXPECT_NE(report.error.find("16 bytes"), std::string::npos) << report.error;
}

TEST(ScheduleChecker, FindsLocalStepsThatDisagreeAndMessagesWithinAHost) {
  ScheduleStep a, b;
  a.local = b.local = true;
  a.digest = 1;
  b.digest = 2;
  const ScheduleReport disagree = checkSchedules({{0, 1}}, {{a}, {b}});
  EXPECT_NE(disagree.error.find("different local collectives"), std::string::npos)
      << disagree.error;
  const ScheduleReport sameHost =
      checkSchedules({{0, 1}}, {{exchangeStep({{1, 8, 0}}, {})}, {exchangeStep({}, {{0, 8, 0}})}});
  EXPECT_NE(sameHost.error.find("not on another host"), std::string::npos) << sameHost.error;
}

}  // namespace
}  // namespace loom
