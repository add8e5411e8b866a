// The descriptor exchange among the ranks of one host (core/fd_exchange, which shares CUDA
// workspaces on a GPU host): every rank gets every rank's descriptor, and a rank that has
// none to offer fails every rank at once with its reason instead of leaving them waiting.

#include "core/fd_exchange.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "../common/forked_ranks.h"
#include "core/process_service.h"
#include "loom/error.h"

namespace loom {
namespace {

using Clock = std::chrono::steady_clock;
using testing::RankContext;

// This rank's part of an exchange among all ranks of the job (they share one host): the
// leader's address travels through the job's store.
detail::FdExchange exchangeFor(const RankContext& ctx) {
  detail::FdExchange x;
  x.id.fill(0x5a);
  x.secret.fill(0x17);
  x.localRank = ctx.rank;
  x.localSize = ctx.size;
  x.op = "fd exchange test";
  x.rank = ctx.rank;
  if (ctx.rank == 0) {
    const std::string& address = ProcessService::instance().address();
    ctx.store->set("leader", std::vector<uint8_t>(address.begin(), address.end()));
  }
  const std::vector<uint8_t> address = ctx.store->get("leader", std::chrono::seconds(60));
  x.leaderAddress.assign(address.begin(), address.end());
  return x;
}

// A memfd holding `value`, standing in for an exported device allocation.
posix::Fd memfdHolding(int value) {
  posix::Fd fd(::memfd_create("fd-exchange-test", MFD_CLOEXEC));
  LOOM_CHECK(fd && ::pwrite(fd.get(), &value, sizeof value, 0) == sizeof value);
  return fd;
}

int valueIn(int fd) {
  int value = -1;
  LOOM_CHECK(::pread(fd, &value, sizeof value, 0) == sizeof value);
  return value;
}

TEST(FdExchange, EveryRankGetsEveryRanksDescriptorInLocalRankOrder) {
  LOOM_RUN_RANKS(3, [](RankContext& ctx) {
    const detail::FdExchange x = exchangeFor(ctx);
    const posix::Fd mine = memfdHolding(100 + ctx.rank);
    const auto all = detail::exchangeFds(x, mine.get(), Clock::now() + std::chrono::seconds(60));
    LOOM_CHECK(all.size() == 3u);
    for (int q = 0; q < 3; ++q) LOOM_CHECK(valueIn(all[q].get()) == 100 + q, << "rank " << q);
  });
}

TEST(FdExchange, ARankWithNothingToOfferFailsEveryRankAtOnceWithItsReason) {
  // Rank 1 refuses (as a rank whose CUDA set-up failed does); the others must learn why at
  // once, long before the exchange's deadline, and so must the leader when it refuses.
  for (int refusing : {1, 0}) {
    LOOM_RUN_RANKS(3, [refusing](RankContext& ctx) {
      const detail::FdExchange x = exchangeFor(ctx);
      const auto deadline = Clock::now() + std::chrono::seconds(600);
      const auto start = Clock::now();
      if (ctx.rank == refusing) {
        detail::refuseFds(x, "cuMemCreate: out of memory", deadline);
      } else {
        const posix::Fd mine = memfdHolding(ctx.rank);
        try {
          detail::exchangeFds(x, mine.get(), deadline);
          LOOM_CHECK(false, << "the exchange succeeded without rank " << refusing);
        } catch (const Error& e) {
          const std::string what = e.what();
          LOOM_CHECK(e.code() == ErrorCode::kPeerFailure, << what);
          LOOM_CHECK(what.find("rank " + std::to_string(refusing) + " has none to share") !=
                         std::string::npos,
                     << what);
          LOOM_CHECK(what.find("cuMemCreate: out of memory") != std::string::npos, << what);
        }
      }
      LOOM_CHECK(Clock::now() - start < std::chrono::seconds(60), << "waited for the deadline");
    });
  }
}

}  // namespace
}  // namespace loom
