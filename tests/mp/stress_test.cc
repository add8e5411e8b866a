// Randomised stress: thousands of mixed collectives (tests/common/stress_driver.h) on two
// communicators driven at once from two threads per rank, every result checked.
// LOOM_STRESS_OPS sets the number of operations per communicator (default 600 in CI; run
// thousands locally).

#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>

#include "../common/forked_ranks.h"
#include "../common/stress_driver.h"

namespace loom {
namespace {

using testing::driveRandomCollectives;

TEST(Stress, MixedCollectivesOnTwoCommunicatorsAtOnce) {
  const char* env = std::getenv("LOOM_STRESS_OPS");
  const int ops = env != nullptr ? std::atoi(env) : 600;
  testing::RunOptions options;
  options.environment = {"LOOM_CHUNK_BYTES=16K"};
  options.timeout = std::chrono::seconds(600);
  const auto outcomes = testing::runRanks(
      4,
      [ops](testing::RankContext& ctx) {
        auto world = ctx.connect();
        auto pair = world->split(ctx.rank % 2, ctx.rank);
        std::string worldFailure;
        std::thread t([&] { worldFailure = driveRandomCollectives(*world, ops, 1); });
        const std::string pairFailure = driveRandomCollectives(*pair, ops, 2 + ctx.rank % 2);
        t.join();
        LOOM_CHECK(worldFailure.empty(), << "world: " << worldFailure);
        LOOM_CHECK(pairFailure.empty(), << "pair: " << pairFailure);
      },
      options);
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

}  // namespace
}  // namespace loom
