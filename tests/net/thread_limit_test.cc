// Processes that cannot start a thread (a pids limit): a rank that cannot start the network
// service's thread while it makes a communicator across hosts fails every rank at once naming
// it and the cause, where its peers used to wait out the creation timeout and it threw a raw
// std::system_error; a tensor-store server that cannot start a sending thread turns its reader
// away and lives on, where the std::system_error used to end its process.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/process_service.h"
#include "net_helpers.h"
#include "transport/net/byte_fetcher.h"
#include "transport/net/byte_server.h"
#include "transport/net/region_source.h"
#include "transport/shm/region.h"

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

TEST_F(TwoHosts, ATensorStoreServerThatCannotStartASendingThreadTurnsTheReaderAwayAndLivesOn) {
  const loom::testing::NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    std::vector<uint8_t> bytes(4096);
    if (ctx.rank == 0) {
      net::NetService service(net::Fabric::instance(), net::NetService::Limits{});
      net::ByteServer server(service, net::Fabric::instance(),
                             net::FetchIdentity{net::testing::kComm, net::testing::kSecret, 1000},
                             net::ByteServer::defaultShape(), net::ByteServer::kQuietLimit);
      std::shared_ptr<shm::Region> region = shm::Region::create(bytes.size());
      region->beginWrite();
      std::memset(region->data(), 0x5a, bytes.size());
      LOOM_CHECK(region->endWrite() == 2);
      server.publish(region->id(), std::make_shared<net::RegionSource>(region));
      threadsRefused = true;  // the service's and the server's own threads run already
      ctx.store->set("address", Bytes(server.address().begin(), server.address().end()));
      ctx.store->set("source", Bytes(region->id().begin(), region->id().end()));
      ctx.store->get("turned away", net::testing::kPatience);
      threadsRefused = false;
      ctx.store->set("threads back", Bytes{1});
      ctx.store->get("served", net::testing::kPatience);
      LOOM_CHECK(server.answered() == 1, << server.answered() << " answered");
      return;
    }
    net::NetService service(net::Fabric::instance(), net::NetService::Limits{});
    net::ByteFetcher fetcher(service, net::Fabric::instance(),
                             net::FetchIdentity{net::testing::kComm, net::testing::kSecret, 1});
    const Bytes a = ctx.store->get("address", net::testing::kPatience);
    const Bytes s = ctx.store->get("source", net::testing::kPatience);
    const std::string address(a.begin(), a.end());
    net::SourceId source{};
    std::memcpy(source.data(), s.data(), source.size());
    const std::vector<net::ByteRange> all{{0, bytes.size()}};
    auto fetch = [&] {
      return fetcher.fetch(address, 1000, source, 2, all, bytes.data(), bytes.size(),
                           std::chrono::steady_clock::now() + std::chrono::seconds(20));
    };
    try {
      fetch();
      LOOM_CHECK(false, << "served by a server that could start no sending thread");
    } catch (const Error& e) {
      LOOM_CHECK(e.code() == ErrorCode::kPeerFailure, << e.what());
    }
    ctx.store->set("turned away", Bytes{1});
    ctx.store->get("threads back", net::testing::kPatience);
    LOOM_CHECK(fetch().state == net::SourceState::kWhole);
    LOOM_CHECK(bytes[0] == 0x5a && bytes.back() == 0x5a);
    ctx.store->set("served", Bytes{1});
  });
}

}  // namespace
}  // namespace loom
