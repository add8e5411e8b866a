// What a rank's death on one host does to the ranks on the other (network namespaces on
// this machine): every survivor fails naming it, whichever host learned first, and the
// survivors go on: they shrink without it or make a group of themselves (torch's new_group
// over a failed world), while a shrink or a group that keeps the dead rank fails within
// seconds. An abort on one host aborts every rank on the other.

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "expect_error.h"
#include "net_helpers.h"

namespace loom {
namespace {

using loom::testing::expectError;
using loom::testing::NetnsHosts;
using loom::testing::RankContext;
using net::testing::hostOfRank;
using net::testing::TwoHosts;

// After a barrier of ranks 0-3 (hostOfRank: 0 and 2 on host 0, 1 and 3 on host 1), kills
// rank 3 once every other rank has left it: a rank may return from a barrier while its last
// message to a peer is still on the wire, and a death then would fail that barrier instead
// of the next. Ranks 0 and 2 say so to rank 1, which tells rank 3 (its host's other rank), so
// ranks 0 and 2 still never send to rank 3 themselves.
void killRank3OnceTheOthersLeftTheBarrier(Communicator& comm, int rank) {
  int32_t token = rank;
  if (rank == 0 || rank == 2) comm.send(&token, 1, DataType::kInt32, 1, 7).wait();
  if (rank == 1) {
    for (int q : {0, 2}) comm.recv(&token, 1, DataType::kInt32, q, 7).wait();
    comm.send(&token, 1, DataType::kInt32, 3, 7).wait();
  }
  if (rank == 3) {
    comm.recv(&token, 1, DataType::kInt32, 1, 7).wait();
    ::raise(SIGKILL);
  }
}

// What a survivor does after the death: its communicator, its context, the options it
// connected with.
using Survivor = std::function<void(Communicator&, RankContext&, const CommOptions&)>;

// Ranks 0 to `world` - 1 (hostOfRank) connect across the two hosts and meet in a barrier;
// then `kill` (every rank calls it) kills rank `dead` once the others have left that
// barrier. The survivors' next barrier fails naming it (the failure and not the timeout
// ending it); then each runs `survivor` and must end well while `dead` stays killed.
void afterARankDies(const NetnsHosts& hosts, int world, int dead,
                    const std::function<void(Communicator&, RankContext&)>& kill,
                    const Survivor& survivor) {
  const auto outcomes = loom::testing::runRanks(world, [&](RankContext& ctx) {
    hosts.enter(hostOfRank(ctx.rank));
    CommOptions options;
    options.timeout = std::chrono::seconds(120);
    auto comm = ctx.connect(options);
    comm->barrier().wait();
    kill(*comm, ctx);
    const std::string named = "rank " + std::to_string(dead);
    expectError([&] { comm->barrier().wait(); }, ErrorCode::kPeerFailure, {named.c_str()});
    survivor(*comm, ctx, options);
  });
  ASSERT_EQ(outcomes.size(), static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    if (r == dead) continue;
    EXPECT_TRUE(outcomes[r].exited && outcomes[r].status == 0) << outcomes[r].output;
  }
  EXPECT_FALSE(outcomes[dead].exited) << outcomes[dead].output;
}

// afterARankDies with ranks 0 to 3, rank 3 killed (killRank3OnceTheOthersLeftTheBarrier).
void afterRank3Dies(const NetnsHosts& hosts, const Survivor& survivor) {
  afterARankDies(
      hosts, 4, 3,
      [](Communicator& comm, RankContext& ctx) {
        killRank3OnceTheOthersLeftTheBarrier(comm, ctx.rank);
      },
      survivor);
}

TEST_F(TwoHosts, ADeathOnOneHostFailsEveryRankOnTheOtherNamingTheDead) {
  // Ranks 0 and 2 on host 0 never talk to rank 3 (host 1) directly: they learn of its
  // death because host 1 forwards it (its rail ranks' control links).
  afterRank3Dies(*hosts_, [](Communicator&, RankContext&, const CommOptions&) {});
}

TEST_F(TwoHosts, AbortOnOneHostAbortsEveryRankOnTheOther) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(4, [&](RankContext& ctx) {
    hosts.enter(hostOfRank(ctx.rank));
    CommOptions options;
    options.timeout = std::chrono::seconds(120);
    auto comm = ctx.connect(options);
    comm->barrier().wait();
    if (ctx.rank == 2) comm->abort();
    expectError([&] { comm->barrier().wait(); }, ErrorCode::kAborted,
                {"rank 2 aborted communicator"});
  });
}

TEST_F(TwoHosts, SurvivorsShrinkAcrossHostsAndGoOn) {
  afterRank3Dies(*hosts_, [](Communicator& comm, RankContext& ctx, const CommOptions& options) {
    // Ranks 0, 2 (host 0) and 1 (host 1) go on without rank 3.
    const int dead[] = {3};
    auto rest = comm.shrink(dead, options);
    LOOM_CHECK(rest->size() == 3);
    std::vector<int32_t> x(100000, ctx.rank + 1);
    rest->allReduce(x.data(), x.data(), x.size(), DataType::kInt32, ReduceKind::kSum).wait();
    LOOM_CHECK(x[99999] == 1 + 2 + 3, << x[99999]);
  });
}

// After rank 3's death the survivors make a group of themselves from the failed world
// (torch's new_group), and one that lists rank 3 fails with the world's failure naming it.
// Ranks on host 0 may know rank 3 is gone only from host 1's report, which names it as the
// failure's cause (not rank 1, which sent the report and is one of the survivors).
TEST_F(TwoHosts, SurvivorsMakeAGroupOfThemselvesAcrossHosts) {
  afterRank3Dies(*hosts_, [](Communicator& comm, RankContext& ctx, const CommOptions& options) {
    const int survivors[] = {0, 1, 2};
    auto rest = comm.subset(survivors, "survivors", options);
    int32_t x = ctx.rank + 1;
    rest->allReduce(&x, &x, 1, DataType::kInt32, ReduceKind::kSum).wait();
    LOOM_CHECK(x == 1 + 2 + 3, << x);
    const int all[] = {0, 1, 2, 3};
    expectError([&] { comm.subset(all, "with the dead", options); }, ErrorCode::kPeerFailure,
                {"rank 3"});
  });
}

// Three ranks, so each host has one rail and one control link (rank 0's to rank 1): rank 2
// (host 0) dies and rank 1 (host 1), which never linked to it, knows only from rank 0's
// report. The report names rank 2 as the cause, so rank 1 makes a group with rank 0 (before
// the report carried its culprit, rank 1 blamed rank 0 and refused it every time).
TEST_F(TwoHosts, AGroupOfSurvivorsKnownOnlyFromAnotherHostsReportIsMade) {
  const auto killRank2 = [](Communicator&, RankContext& ctx) {
    // Once the others have left the barrier (a store the ranks share, so rank 1 never
    // hears from rank 2 itself).
    if (ctx.rank == 2) {
      for (int q : {0, 1}) ctx.store->get("left " + std::to_string(q), std::chrono::seconds(60));
      ::raise(SIGKILL);
    }
    ctx.store->set("left " + std::to_string(ctx.rank), {1});
  };
  afterARankDies(*hosts_, 3, 2, killRank2,
                 [](Communicator& comm, RankContext& ctx, const CommOptions& options) {
                   const int survivors[] = {0, 1};
                   auto rest = comm.subset(survivors, "survivors", options);
                   int32_t x = ctx.rank + 1;
                   rest->allReduce(&x, &x, 1, DataType::kInt32, ReduceKind::kSum).wait();
                   LOOM_CHECK(x == 1 + 2, << x);
                   const int all[] = {0, 1, 2};
                   expectError([&] { comm.subset(all, "with the dead", options); },
                               ErrorCode::kPeerFailure, {"rank 2"});
                 });
}

// Ranks 0 to 3 (0 and 2 on host 0, 1 and 3 on host 1) lose rank 3, and the survivors but
// `left` shrink without `left` instead, so rank 3 is kept: every one of them must fail
// within seconds, at the shrink or (a rank whose part of the making ended before the hosts
// met) at its first call, with an error containing `says` (the shrink's, where it fails
// there, saying which rank of 'world' each of its ranks is), never wait out the timeout.
void shrinkKeepingTheDeadFails(const NetnsHosts& hosts, int left,
                               std::function<std::vector<const char*>(int)> says) {
  afterRank3Dies(hosts, [&](Communicator& comm, RankContext& ctx, const CommOptions& options) {
    if (ctx.rank == left) return;
    const int wrong[] = {left};
    const auto start = std::chrono::steady_clock::now();
    std::string message;
    try {
      comm.shrink(wrong, options)->barrier().wait();
    } catch (const Error& e) {
      LOOM_CHECK(e.code() == ErrorCode::kPeerFailure, << e.what());
      message = e.what();
    }
    LOOM_CHECK(!message.empty(), << "a shrink that kept a dead rank made a working communicator");
    for (const char* part : says(ctx.rank)) {
      LOOM_CHECK(message.find(part) != std::string::npos, << "lacks '" << part << "': " << message);
    }
    const auto took = std::chrono::steady_clock::now() - start;
    LOOM_CHECK(took < std::chrono::seconds(30),
               << "failed only after "
               << std::chrono::duration_cast<std::chrono::seconds>(took).count() << " s");
  });
}

TEST_F(TwoHosts, AShrinkKeepingADeadRankFailsOnEveryHostWithinSeconds) {
  // Rank 3 is rank 2 of the shrink (0, 1, 3): rank 1 sees it exit as host 1's segment is
  // made (before, its error said "rank 2 exited" with nothing to tell it from the rank 2 the
  // caller left out); rank 0, alone on host 0, hears that rank 1 gave up.
  shrinkKeepingTheDeadFails(*hosts_, 2, [](int rank) {
    return rank == 1 ? std::vector<const char*>{"rank 2 (pid", "exited",
                                                "its ranks 0 to 2 are ranks 0, 1, 3 of 'world'"}
                     : std::vector<const char*>{"rank 1", "are ranks 0, 1, 3 of 'world'"};
  });
}

TEST_F(TwoHosts, AShrinkKeepingADeadRankAloneOnItsHostFailsWithinSeconds) {
  // The shrink (0, 2, 3) leaves rank 3 alone on host 1: rank 0, host 0's rail to it, finds
  // its connection refused; rank 2, which has no rail of its own, finishes making its part
  // and fails at its first call, as host 0's segment tells it.
  shrinkKeepingTheDeadFails(*hosts_, 1, [](int rank) {
    return rank == 0 ? std::vector<const char*>{"rank 2", "are ranks 0, 2, 3 of 'world'"}
                     : std::vector<const char*>{"rank 2"};
  });
}

}  // namespace
}  // namespace loom
