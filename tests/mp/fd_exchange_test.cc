// The descriptor exchange among the ranks of one host (core/fd_exchange, which shares CUDA
// workspaces on a GPU host): every rank gets every rank's descriptor, and a rank that has
// none to offer fails every rank at once with its reason instead of leaving them waiting.

#include "core/fd_exchange.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "../common/forked_ranks.h"
#include "core/handshake.h"
#include "core/process_service.h"
#include "loom/error.h"
#include "util/unix_socket.h"

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

TEST(FdExchange, EveryRankGetsEveryRanksDescriptorAndNoteInLocalRankOrder) {
  LOOM_RUN_RANKS(3, [](RankContext& ctx) {
    const detail::FdExchange x = exchangeFor(ctx);
    const posix::Fd mine = memfdHolding(100 + ctx.rank);
    // Rank 1 says nothing; the others a note of their own, rank 2's as long as one may be.
    const std::string note = ctx.rank == 1   ? ""
                             : ctx.rank == 2 ? std::string(detail::kMaxFdNote, 'n')
                                             : "rank 0's";
    const auto all =
        detail::exchangeFds(x, mine.get(), note, Clock::now() + std::chrono::seconds(60));
    LOOM_CHECK(all.size() == 3u);
    for (int q = 0; q < 3; ++q) LOOM_CHECK(valueIn(all[q].fd.get()) == 100 + q, << "rank " << q);
    LOOM_CHECK(all[0].note == "rank 0's", << all[0].note);
    LOOM_CHECK(all[1].note.empty(), << all[1].note);
    LOOM_CHECK(all[2].note == std::string(detail::kMaxFdNote, 'n'), << all[2].note);
  });
}

TEST(FdExchange, ANoteTooLongToTravelIsRefusedBeforeAnythingIsSent) {
  detail::FdExchange x;
  x.op = "fd exchange test";
  x.localSize = 2;
  const posix::Fd mine = memfdHolding(1);
  try {
    detail::exchangeFds(x, mine.get(), std::string(detail::kMaxFdNote + 1, 'n'),
                        Clock::now() + std::chrono::seconds(60));
    FAIL() << "a note of " << detail::kMaxFdNote + 1 << " characters was sent";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInternal);
    EXPECT_NE(std::string(e.what()).find("at most " + std::to_string(detail::kMaxFdNote)),
              std::string::npos)
        << e.what();
  }
}

TEST(FdExchange, RanksWithNothingToOfferFailEveryRankAtOnceWithTheirReason) {
  // A member refuses (as a rank whose CUDA set-up failed does), then the leader, then two
  // members: the others must learn why at once, long before the exchange's deadline, as an
  // ExchangeRefused (no rank holds another's descriptor then).
  for (const std::vector<int>& refusing :
       {std::vector<int>{1}, std::vector<int>{0}, std::vector<int>{1, 2}}) {
    LOOM_RUN_RANKS(3, [&refusing](RankContext& ctx) {
      const detail::FdExchange x = exchangeFor(ctx);
      const auto deadline = Clock::now() + std::chrono::seconds(600);
      const auto start = Clock::now();
      if (std::find(refusing.begin(), refusing.end(), ctx.rank) != refusing.end()) {
        detail::refuseFds(x, "cuMemCreate: out of memory", deadline);
      } else {
        const posix::Fd mine = memfdHolding(ctx.rank);
        try {
          detail::exchangeFds(x, mine.get(), "", deadline);
          LOOM_CHECK(false, << "the exchange succeeded without rank " << refusing[0]);
        } catch (const detail::ExchangeRefused& e) {
          const std::string what = e.what();
          LOOM_CHECK(e.code() == ErrorCode::kPeerFailure, << what);
          // Each refusal names its rank; the leader reports the first it reads.
          bool named = false;
          for (int q : refusing)
            named |=
                what.find("rank " + std::to_string(q) + " has none to share") != std::string::npos;
          LOOM_CHECK(named, << what);
          LOOM_CHECK(what.find("cuMemCreate: out of memory") != std::string::npos, << what);
          if (refusing.size() > 1) {
            LOOM_CHECK(what.find("and 1 more rank") != std::string::npos, << what);
          }
        }
      }
      LOOM_CHECK(Clock::now() - start < std::chrono::seconds(60), << "waited for the deadline");
    });
  }
}

TEST(FdExchange, AMemberThatLeavesBeforeOfferingFailsTheOthersAtOnce) {
  // Rank 2 joins and exits without offering: the leader and rank 1 learn it at once, by
  // name, rather than at the deadline (and not as a refusal).
  LOOM_RUN_RANKS(3, [](RankContext& ctx) {
    detail::FdExchange x = exchangeFor(ctx);
    const auto deadline = Clock::now() + std::chrono::seconds(600);
    if (ctx.rank == 2) {
      const posix::Fd socket = ProcessService::instance().introduce(
          x.leaderAddress, {x.id, x.secret, x.localRank, ::getpid()}, x.rank, deadline);
      uint8_t welcome[handshake::kWelcomeBytes];
      posix::Fd none;
      LOOM_CHECK(unix_socket::recvWithFd(socket.get(), welcome, sizeof welcome, &none, deadline));
      return;  // welcomed, it leaves before offering (its socket closes)
    }
    const auto start = Clock::now();
    const posix::Fd mine = memfdHolding(ctx.rank);
    try {
      detail::exchangeFds(x, mine.get(), "", deadline);
      LOOM_CHECK(false, << "the exchange succeeded without rank 2");
    } catch (const detail::ExchangeRefused& e) {
      LOOM_CHECK(false, << "a rank that left was reported as a refusal: " << e.what());
    } catch (const Error& e) {
      const std::string what = e.what();
      LOOM_CHECK(e.code() == ErrorCode::kPeerFailure, << what);
      LOOM_CHECK(what.find("local rank 2 disconnected") != std::string::npos, << what);
    }
    LOOM_CHECK(Clock::now() - start < std::chrono::seconds(60), << "waited for the deadline");
  });
}

// A process that has exited before it is watched (a rank that died between joining and its
// peers' first look) is reported at once: nothing else would say so before an operation's
// timeout.
TEST(ProcessWatch, AProcessGoneBeforeItIsWatchedIsReportedAtOnce) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // reaped: the pid names no process now
  int reported = -1;
  const uint64_t id =
      ProcessService::instance().watch(child, [&reported](int pid) { reported = pid; });
  EXPECT_EQ(id, 0u);
  EXPECT_EQ(reported, child);
}

}  // namespace
}  // namespace loom
