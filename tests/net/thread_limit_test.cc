// A rank that cannot start the network service's thread (a pids limit) while it makes a
// communicator across hosts: every rank fails at once naming it and the cause, where its peers
// used to wait out the creation timeout and it threw a raw std::system_error.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <string>

#include "core/process_service.h"
#include "net_helpers.h"

namespace {
// While set, this process can start no thread (EAGAIN, as under a pids limit). The test binary's
// own definition takes the place of libc's for everything linked into it.
std::atomic<bool> threadsRefused{false};
}  // namespace

extern "C" int pthread_create(pthread_t* thread, const pthread_attr_t* attr, void* (*start)(void*),
                              void* arg) {
  using Real = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  static const Real real = reinterpret_cast<Real>(dlsym(RTLD_NEXT, "pthread_create"));
  if (threadsRefused.load()) return EAGAIN;
  return real(thread, attr, start, arg);
}

namespace loom {
namespace {

using loom::testing::RankContext;
using net::testing::TwoHosts;

TEST_F(TwoHosts, ARankThatCannotStartTheNetworkThreadFailsEveryRankAtOnceNamingIt) {
  const loom::testing::NetnsHosts& hosts = *hosts_;
  loom::testing::RunOptions run;
  run.timeout = std::chrono::seconds(60);
  const auto outcomes = loom::testing::runRanks(
      2,
      [&](RankContext& ctx) {
        hosts.enter(ctx.rank);
        CommOptions options;
        options.timeout = std::chrono::seconds(30);
        if (ctx.rank == 1) {
          ProcessService::instance();  // threads it needs before the limit bites
          net::Fabric::instance();
          threadsRefused = true;
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          auto comm = ctx.connect(options);
          LOOM_CHECK(false, << "a communicator was made though rank 1 cannot open the network");
        } catch (const Error& e) {
          threadsRefused = false;
          const std::string what = e.what();
          LOOM_CHECK(what.find("Resource temporarily unavailable") != std::string::npos, << what);
          if (ctx.rank == 0) {
            LOOM_CHECK(what.find("rank 1 cannot open the network") != std::string::npos, << what);
          }
        }
        LOOM_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20),
                   << "rank " << ctx.rank << " waited for the creation timeout");
      },
      run);
  for (const auto& o : outcomes) EXPECT_TRUE(o.exited && o.status == 0) << o.output;
}

}  // namespace
}  // namespace loom
