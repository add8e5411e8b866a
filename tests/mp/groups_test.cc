// Sub-communicators: split by color and key, subsets called by members only, nesting, and
// several communicators running collectives at once from different threads.

#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <thread>

#include "../common/expect_error.h"
#include "../common/forked_ranks.h"
#include "../common/reference.h"
#include "loom/error.h"

namespace loom {
namespace {

using testing::expectError;
using testing::RankContext;

// Every rank of `body` must exit 0; small chunks, so that collectives take several steps.
void expectOk(int size, const std::function<void(RankContext&)>& body) {
  testing::RunOptions options;
  options.environment = {"LOOM_CHUNK_BYTES=16K"};
  testing::expectAllSucceeded(size, body, options);
}

// Every rank stays alive until all have passed here (a rank that failed would otherwise exit,
// and its exit, not the code under test, would release the others' waits).
void awaitEveryRank(RankContext& ctx, int size) {
  ctx.store->set("done " + std::to_string(ctx.rank), {1});
  for (int q = 0; q < size; ++q)
    ctx.store->get("done " + std::to_string(q), std::chrono::seconds(120));
}

// Sum over the group of each member's parent rank.
int64_t sumOfParentRanks(Communicator& comm, int parentRank) {
  int64_t mine = parentRank, sum = 0;
  comm.allReduce(&mine, &sum, 1, DataType::kInt64, ReduceKind::kSum).wait();
  return sum;
}

TEST(Groups, SplitByColorOrdersByKey) {
  expectOk(5, [](RankContext& ctx) {
    auto world = ctx.connect();
    // Even and odd ranks; key = -rank reverses the order inside each group.
    auto half = world->split(ctx.rank % 2, -ctx.rank);
    LOOM_CHECK(half != nullptr);
    const int evens = 3, odds = 2;
    LOOM_CHECK(half->size() == (ctx.rank % 2 == 0 ? evens : odds), << half->size());
    const int expectedRank = ctx.rank % 2 == 0 ? (4 - ctx.rank) / 2 : (3 - ctx.rank) / 2;
    LOOM_CHECK(half->rank() == expectedRank, << half->rank());
    LOOM_CHECK(sumOfParentRanks(*half, ctx.rank) == (ctx.rank % 2 == 0 ? 0 + 2 + 4 : 1 + 3));
    // A negative color opts out; the others still get a working group.
    auto some = world->split(ctx.rank == 0 ? -1 : 0, 0);
    LOOM_CHECK((some == nullptr) == (ctx.rank == 0));
    if (some) LOOM_CHECK(sumOfParentRanks(*some, ctx.rank) == 1 + 2 + 3 + 4);
    // Nested: split the halves again.
    auto quarter = half->split(half->rank() % 2, 0);
    LOOM_CHECK(quarter != nullptr);
    quarter->barrier().wait();
    LOOM_CHECK(sumOfParentRanks(*world, ctx.rank) == 10);
  });
}

TEST(Groups, SubsetIsCalledByMembersOnly) {
  expectOk(4, [](RankContext& ctx) {
    auto world = ctx.connect();
    const std::vector<int> members{3, 0, 2};  // new ranks 0, 1, 2 in list order
    if (ctx.rank != 1) {
      auto group = world->subset(members, "tp");
      const int expected = ctx.rank == 3 ? 0 : ctx.rank == 0 ? 1 : 2;
      LOOM_CHECK(group->rank() == expected && group->size() == 3);
      LOOM_CHECK(sumOfParentRanks(*group, ctx.rank) == 5);
      // The same members and tag again give a second, independent communicator.
      auto again = world->subset(members, "tp");
      LOOM_CHECK(sumOfParentRanks(*again, ctx.rank) == 5);
      LOOM_CHECK(sumOfParentRanks(*group, ctx.rank) == 5);
    }
    LOOM_CHECK(sumOfParentRanks(*world, ctx.rank) == 6);
  });
}

// Each rank's creation deadline counts from its own call. A member that arrived, then gave
// up (its short timeout ran out while rank 3 was still coming), leaves no rank holding a
// communicator it never joined: every rank's subset fails, the others naming it; none is left
// to find out at its first collective's timeout.
TEST(Groups, AMemberThatGaveUpWhileOthersCameFailsEveryRanksCreation) {
  expectOk(4, [](RankContext& ctx) {
    auto world = ctx.connect();
    const int all[] = {0, 1, 2, 3};
    CommOptions options;
    options.timeout = std::chrono::seconds(20);
    if (ctx.rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // after rank 2
      options.timeout = std::chrono::milliseconds(300);
    }
    if (ctx.rank == 3) ctx.store->get("rank 1 gave up", std::chrono::seconds(60));
    std::shared_ptr<Communicator> group;
    try {
      group = world->subset(all, "late", options);
    } catch (const Error& e) {
      if (ctx.rank == 1) ctx.store->set("rank 1 gave up", {1});
      const std::string what = e.what();
      LOOM_CHECK(ctx.rank == 1 || what.find("rank 1 gave up joining") != std::string::npos,
                 << what);
    }
    if (group) {
      // Made anyway (not on this code): its first collective must fail for the reason, not
      // wait until the timeout for a rank that never joined.
      try {
        group->barrier().wait();
        LOOM_CHECK(false, << "rank " << ctx.rank << " used a communicator rank 1 never joined");
      } catch (const Error& e) {
        LOOM_CHECK(e.code() != ErrorCode::kTimeout, << e.what());
      }
    }
    awaitEveryRank(ctx, 4);
  });
}

// A failed communicator still makes subsets of ranks that all live (torch's new_group after
// a timeout, as Gloo's does over the store); one that lists the rank that aborted it gets the
// failure naming that rank at once, not a wait for a rank that will not come.
TEST(Groups, AFailedCommunicatorMakesSubsetsOfTheRanksItSpares) {
  expectOk(3, [](RankContext& ctx) {
    CommOptions quick;
    quick.timeout = std::chrono::milliseconds(1500);
    auto world = ctx.connect(quick);
    CommOptions options;
    options.timeout = std::chrono::seconds(60);
    const int all[] = {0, 1, 2};
    // Failed for every rank by a timeout (rank 2 is late); every rank lives.
    if (ctx.rank == 2) std::this_thread::sleep_for(std::chrono::milliseconds(3000));
    expectError([&] { world->barrier().wait(); }, ErrorCode::kTimeout, {"rank"});
    auto again = world->subset(all, "after the timeout", options);
    LOOM_CHECK(sumOfParentRanks(*again, ctx.rank) == 0 + 1 + 2);
    // Failed by rank 1's abort: a group with rank 1 is refused, one without it is made.
    if (ctx.rank == 1) again->abort();
    expectError([&] { again->barrier().wait(); }, ErrorCode::kAborted, {"rank 1 aborted"});
    expectError([&] { again->subset(all, "with the aborter", options); }, ErrorCode::kAborted,
                {"rank 1 aborted"});
    if (ctx.rank == 1) return;
    const int others[] = {0, 2};
    auto two = again->subset(others, "without the aborter", options);
    LOOM_CHECK(sumOfParentRanks(*two, ctx.rank) == 0 + 2);
  });
}

// The failed communicator's record keeps its first failure: a group listing a rank that died
// after it (a timeout, then a death) is refused naming the death, not with the timeout,
// which names another rank and would send its reader looking for the wrong one.
TEST(Groups, AGroupListingARankThatDiedAfterAnEarlierFailureNamesTheDeath) {
  expectOk(3, [](RankContext& ctx) {
    CommOptions quick;
    quick.timeout = std::chrono::milliseconds(1500);
    auto world = ctx.connect(quick);
    if (ctx.rank == 2) std::this_thread::sleep_for(std::chrono::milliseconds(3000));
    expectError([&] { world->barrier().wait(); }, ErrorCode::kTimeout, {"rank"});
    awaitEveryRank(ctx, 3);
    if (ctx.rank == 1) _exit(0);  // dies without leaving
    CommOptions options;
    options.timeout = std::chrono::seconds(60);
    const int all[] = {0, 1, 2};
    // Refused at once where the death is known, or while the members meet, by the watch on
    // the parent ("exited after it had failed", the timeout beside it) or by the leader's
    // own look at rank 1's process ("exited while this communicator was being made"): a
    // death named either way, where the timeout's message named rank 2.
    expectError([&] { world->subset(all, "with the dead rank", options); }, ErrorCode::kPeerFailure,
                {"rank 1 (pid", "exited"});
    const int others[] = {0, 2};
    auto two = world->subset(others, "without it", options);
    LOOM_CHECK(sumOfParentRanks(*two, ctx.rank) == 0 + 2);
  });
}

// A failure of the parent that spares a child's members, landing while they make it (rank
// 2 dies after rank 0, the child's leader, began waiting and before rank 1 came), stops
// neither: rank 0 went on waiting, and rank 1 was let in, so both must finish making it.
TEST(Groups, AFailureThatSparesTheMembersLandingWhileTheyMeetStopsNeither) {
  expectOk(3, [](RankContext& ctx) {
    auto world = ctx.connect();
    CommOptions options;
    options.timeout = std::chrono::seconds(60);
    const int pair[] = {0, 1};
    awaitEveryRank(ctx, 3);
    if (ctx.rank == 2) {
      ctx.store->get("rank 0 is making the pair", std::chrono::seconds(60));
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      _exit(0);
    }
    if (ctx.rank == 0) ctx.store->set("rank 0 is making the pair", {1});
    if (ctx.rank == 1) {
      // Until the world has failed for rank 2's death.
      for (;;) {
        try {
          world->requireUsable("probe");
        } catch (const Error& e) {
          LOOM_CHECK(e.code() == ErrorCode::kPeerFailure, << e.what());
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      // Long enough for rank 0, which looks at its parent every 50 ms while it waits, to
      // see the failure first.
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
    auto made = world->subset(pair, "pair", options);
    LOOM_CHECK(sumOfParentRanks(*made, ctx.rank) == 0 + 1);
  });
}

// A leader that gave up (its own timeout) tells a member that comes later at once, with its
// reason, instead of the member waiting out its own, longer timeout.
TEST(Groups, ALeaderThatGaveUpTellsAMemberThatComesLater) {
  expectOk(2, [](RankContext& ctx) {
    auto world = ctx.connect();
    const int both[] = {0, 1};
    CommOptions options;
    options.timeout = ctx.rank == 0 ? std::chrono::milliseconds(300) : std::chrono::seconds(20);
    if (ctx.rank == 1) ctx.store->get("rank 0 gave up", std::chrono::seconds(60));
    try {
      world->subset(both, "alone", options);
      LOOM_CHECK(false, << "made without both ranks");
    } catch (const Error& e) {
      const std::string what = e.what();
      if (ctx.rank == 0) {
        ctx.store->set("rank 0 gave up", {1});
        LOOM_CHECK(e.code() == ErrorCode::kTimeout &&
                       what.find("rank(s) 1 never connected") != std::string::npos &&
                       what.find("did every member make this group") != std::string::npos,
                   << what);
      } else {
        LOOM_CHECK(e.code() == ErrorCode::kPeerFailure &&
                       what.find("rank 0, gave up making it") != std::string::npos,
                   << what);
      }
    }
    awaitEveryRank(ctx, 2);
  });
}

// A member already waiting when its leader gives up hears the leader's reason, not only
// that the connection closed.
TEST(Groups, AMemberWaitingOnALeaderThatGaveUpIsToldWhy) {
  expectOk(3, [](RankContext& ctx) {
    auto world = ctx.connect();
    if (ctx.rank != 2) {  // rank 2 never comes
      const int all[] = {0, 1, 2};
      CommOptions options;
      options.timeout = ctx.rank == 0 ? std::chrono::milliseconds(500) : std::chrono::seconds(20);
      try {
        world->subset(all, "without 2", options);
        LOOM_CHECK(false, << "made without rank 2");
      } catch (const Error& e) {
        const std::string what = e.what();
        LOOM_CHECK(ctx.rank == 0 ? e.code() == ErrorCode::kTimeout
                                 : e.code() == ErrorCode::kPeerFailure &&
                                       what.find("rank 0, gave up making it: rank(s) 2 never "
                                                 "connected") != std::string::npos,
                   << what);
      }
    }
    awaitEveryRank(ctx, 3);
  });
}

int openDescriptors() {
  int n = 0;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (::readdir(dir) != nullptr) ++n;
    ::closedir(dir);
  }
  return n;
}

// A process watches each peer process once, however many communicators it shares with it:
// a job that keeps many groups alive (meshes, subgroups) does not run out of descriptors
// for pidfds, and a watch that could not be opened would leave a dead peer to be found only
// by the timeout.
TEST(Groups, ManyGroupsWatchEachPeerProcessOnce) {
  expectOk(4, [](RankContext& ctx) {
    auto world = ctx.connect();
    const int all[] = {0, 1, 2, 3};
    std::vector<std::shared_ptr<Communicator>> groups;
    groups.push_back(world->subset(all, "warm-up"));  // the first group's one-off costs
    const int before = openDescriptors();
    constexpr int kGroups = 16;
    for (int i = 0; i < kGroups; ++i) groups.push_back(world->subset(all, "many"));
    const int perGroup = (openDescriptors() - before) / kGroups;
    // A group's own: its segment; not one pidfd per peer (3 here) for every group.
    LOOM_CHECK(perGroup <= 1, << perGroup << " descriptors per group");
    LOOM_CHECK(sumOfParentRanks(*groups.back(), ctx.rank) == 6);
  });
}

TEST(Groups, SeveralCommunicatorsInFlightAtOnce) {
  expectOk(4, [](RankContext& ctx) {
    auto world = ctx.connect();
    auto pair = world->split(ctx.rank / 2, ctx.rank);
    // Each thread drives its own communicator; both run collectives concurrently.
    auto drive = [](Communicator& comm, int rounds, uint32_t salt) -> std::string {
      try {
        for (int i = 0; i < rounds; ++i) {
          const size_t count = 1000 + 517 * static_cast<size_t>(i % 13);
          auto in = testing::inputBytes(DataType::kFloat32, count, comm.rank(), salt + i);
          std::vector<uint8_t> out(in.size());
          comm.allReduce(in.data(), out.data(), count, DataType::kFloat32, ReduceKind::kSum).wait();
          const auto want = testing::referenceReduce(DataType::kFloat32, ReduceKind::kSum, count,
                                                     comm.size(), salt + i);
          if (out != want) return "wrong result in round " + std::to_string(i);
        }
      } catch (const std::exception& e) {
        return e.what();
      }
      return "";
    };
    std::string worldFailure;
    std::thread a([&] { worldFailure = drive(*world, 200, 1); });
    const std::string pairFailure = drive(*pair, 200, 100000);
    a.join();
    LOOM_CHECK(worldFailure.empty(), << worldFailure);
    LOOM_CHECK(pairFailure.empty(), << pairFailure);
  });
}

}  // namespace
}  // namespace loom
