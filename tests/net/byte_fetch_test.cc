// The tensor store's byte fetch across hosts: a reader on another host copies ranges of a
// region exactly, learns where the region stands when it does not hold the generation asked
// for, is told by name when the server is gone, a reader that dies mid-reply costs the
// server that session alone, a fetch behind one that times out gets its bytes, readers of
// one staged source at once each get their bytes, a reader whose host vanished costs the
// server its session only until the quiet limit, a fetch from a vanished host stops when
// told, a live reader whose idle session ended fetches again, and a reader lets go of the
// connections of servers that left.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "net_helpers.h"
#include "transport/net/byte_fetcher.h"
#include "transport/net/byte_server.h"
#include "transport/net/region_source.h"
#include "transport/shm/region.h"

namespace loom::net {
namespace {

using namespace loom::net::testing;

const FetchIdentity kIdentity{kComm, kSecret, 0};

FetchIdentity as(int id) {
  FetchIdentity identity = kIdentity;
  identity.id = id;
  return identity;
}

uint8_t pattern(uint64_t i, uint64_t generation) {
  return static_cast<uint8_t>((i * 131) ^ (i >> 9) ^ (generation * 29));
}

void fill(shm::Region& region, uint64_t generation) {
  for (uint64_t i = 0; i < region.capacity(); ++i) region.data()[i] = pattern(i, generation);
}

// Rank 0's server in host 0: publishes a region and tells the store where it is (under
// `name`, where a test has several servers).
struct Served {
  explicit Served(RankContext& ctx, size_t capacity,
                  std::chrono::milliseconds quietLimit = ByteServer::kQuietLimit,
                  const std::string& name = "")
      : service(Fabric::instance(), NetService::Limits{}),
        server(service, Fabric::instance(), as(1000), ByteServer::defaultShape(), quietLimit),
        region(shm::Region::create(capacity)) {
    region->beginWrite();
    fill(*region, 2);
    LOOM_CHECK(region->endWrite() == 2);
    server.publish(region->id(), std::make_shared<RegionSource>(region));
    ctx.store->set(name + "address", Bytes(server.address().begin(), server.address().end()));
    ctx.store->set(name + "source", Bytes(region->id().begin(), region->id().end()));
  }
  NetService service;
  ByteServer server;
  std::shared_ptr<shm::Region> region;
};

// A reader in host 1, with what it needs to find the server.
struct Reader {
  explicit Reader(RankContext& ctx, const std::string& name = "")
      : service(Fabric::instance(), NetService::Limits{}),
        fetcher(service, Fabric::instance(), as(ctx.rank)) {
    find(ctx, name);
  }
  // Reads from the server the store names under `name` from now on.
  void find(RankContext& ctx, const std::string& name) {
    const Bytes a = ctx.store->get(name + "address", kPatience);
    address.assign(a.begin(), a.end());
    const Bytes s = ctx.store->get(name + "source", kPatience);
    std::memcpy(source.data(), s.data(), source.size());
  }
  ByteFetcher::Outcome fetch(uint64_t generation, const std::vector<ByteRange>& ranges,
                             std::vector<uint8_t>& dst, SourceId which = {}) {
    if (which == SourceId{}) which = source;
    return fetcher.fetch(address, 1000, which, generation, ranges, dst.data(), dst.size(),
                         Clock::now() + kPatience);
  }
  NetService service;
  ByteFetcher fetcher;
  std::string address;
  SourceId source{};
};

void expectPattern(const std::vector<uint8_t>& dst, const std::vector<ByteRange>& ranges,
                   uint64_t generation) {
  for (const ByteRange& r : ranges) {
    for (uint64_t i = r.offset; i < r.offset + r.length; ++i) {
      LOOM_CHECK(dst[i] == pattern(i, generation),
                 << "byte " << i << " of generation " << generation);
    }
  }
}

// Waits until `server` has at most `most` readers' sessions open.
void awaitSessions(const ByteServer& server, size_t most) {
  const auto deadline = Clock::now() + kPatience;
  while (server.sessions() > most) {
    LOOM_CHECK(Clock::now() < deadline, << server.sessions() << " sessions left");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

constexpr size_t kCapacity = (size_t{3} << 20) + 123;

// Waits until process `pid` has exited (gone, or a zombie its parent has not reaped yet).
void awaitExit(int pid) {
  const auto deadline = Clock::now() + kPatience;
  for (;;) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return;
    // The state follows the command's closing parenthesis.
    const size_t close = line.rfind(')');
    if (close != std::string::npos && close + 2 < line.size() && line[close + 2] == 'Z') return;
    LOOM_CHECK(Clock::now() < deadline, << "process " << pid << " did not exit");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

TEST_F(TwoHosts, ReaderFetchesRangesAndLearnsWhereTheSourceStands) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    if (ctx.rank == 0) {
      Served served(ctx, kCapacity);
      ctx.store->get("read whole", kPatience);
      served.region->beginWrite();  // generation 3: the write that makes 4 is under way
      served.region->setProgress(1000);
      ctx.store->set("writing", Bytes{1});
      ctx.store->get("read writing", kPatience);
      fill(*served.region, 4);
      LOOM_CHECK(served.region->endWrite() == 4);
      ctx.store->set("rewritten", Bytes{1});
      ctx.store->get("done", kPatience);
      LOOM_CHECK(served.server.answered() == 6, << served.server.answered() << " answered");
      return;
    }
    Reader reader(ctx);
    std::vector<uint8_t> dst(kCapacity, 0);
    const std::vector<ByteRange> ranges{
        {0, 100}, {4096, (size_t{3} << 20) - 4096}, {kCapacity - 23, 23}};
    auto outcome = reader.fetch(2, ranges, dst);
    LOOM_CHECK(outcome.state == SourceState::kWhole && outcome.unchanged &&
               outcome.generation == 2);
    expectPattern(dst, ranges, 2);
    LOOM_CHECK(dst[100] == 0 && dst[4095] == 0, << "bytes outside the ranges were written");
    outcome = reader.fetch(4, {{0, 10}}, dst);
    LOOM_CHECK(outcome.state == SourceState::kPending && outcome.generation == 2);
    SourceId unknown{};
    unknown[0] = 0xee;
    LOOM_CHECK(reader.fetch(2, {{0, 10}}, dst, unknown).state == SourceState::kUnknown);
    ctx.store->set("read whole", Bytes{1});
    ctx.store->get("writing", kPatience);
    outcome = reader.fetch(4, {{0, 10}}, dst);
    LOOM_CHECK(outcome.state == SourceState::kWriting && outcome.progress == 1000);
    LOOM_CHECK(reader.fetch(2, {{0, 10}}, dst).state == SourceState::kReplaced);
    ctx.store->set("read writing", Bytes{1});
    ctx.store->get("rewritten", kPatience);
    const std::vector<ByteRange> all{{0, kCapacity}};
    outcome = reader.fetch(4, all, dst);
    LOOM_CHECK(outcome.state == SourceState::kWhole && outcome.unchanged);
    expectPattern(dst, all, 4);
    LOOM_CHECK(reader.fetcher.connections() == 1, << "one connection per server");
    ctx.store->set("done", Bytes{1});
  });
}

TEST_F(TwoHosts, FetchFromAServerThatLeftFailsNamingIt) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    if (ctx.rank == 0) {
      Served served(ctx, 4096);
      ctx.store->get("fetched", kPatience);
      return;  // the server closes, then the process exits
    }
    Reader reader(ctx);
    std::vector<uint8_t> dst(4096);
    LOOM_CHECK(reader.fetch(2, {{0, 4096}}, dst).state == SourceState::kWhole);
    ctx.store->set("fetched", Bytes{1});
    // The server's leaving is seen on the next fetch, or a fetch after it (the connection
    // may still be closing); never a timeout.
    for (int attempt = 0; attempt < 2; ++attempt) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      try {
        reader.fetch(2, {{0, 4096}}, dst);
      } catch (const Error& e) {
        LOOM_CHECK(e.code() == ErrorCode::kPeerFailure, << e.what());
        LOOM_CHECK(std::string(e.what()).find("tensor-store server 1000 at " + reader.address) !=
                       std::string::npos,
                   << e.what());
        if (attempt == 1 || std::string(e.what()).find("closed") != std::string::npos) return;
      }
    }
    LOOM_CHECK(false, << "fetches from a server that left did not fail");
  });
}

TEST_F(TwoHosts, ReaderThatDiesMidReplyCostsTheServerItsSessionAlone) {
  const NetnsHosts& hosts = *hosts_;
  constexpr size_t kBig = size_t{64} << 20;
  LOOM_RUN_RANKS(3, [&](RankContext& ctx) {
    hosts.enter(ctx.rank == 0 ? 0 : 1);
    if (ctx.rank == 0) {
      Served served(ctx, kBig);
      ctx.store->get("reader 2 done", kPatience);
      // Reader 1's session is gone; reader 2's may still be open until it leaves.
      awaitSessions(served.server, 1);
      return;
    }
    Reader reader(ctx);
    std::vector<uint8_t> dst(kBig);
    if (ctx.rank == 1) {
      // Asks for everything, then dies while the reply streams.
      std::thread fetching([&] {
        try {
          reader.fetch(2, {{0, kBig}}, dst);
        } catch (const Error&) {
        }
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ctx.store->set("reader 1 died", Bytes{1});
      _exit(0);
    }
    ctx.store->get("reader 1 died", kPatience);
    const auto outcome = reader.fetch(2, {{0, kBig}}, dst);
    LOOM_CHECK(outcome.state == SourceState::kWhole && outcome.unchanged);
    expectPattern(dst, {{0, kBig}}, 2);
    ctx.store->set("reader 2 done", Bytes{1});
  });
}

// A fetch that times out mid-reply breaks its connection; a fetch that was waiting for it
// makes a new one rather than read the broken one's leftovers (it used to fail with a
// "malformed reply"), and the server ends the broken connection's session.
TEST_F(TwoHosts, AFetchWaitingBehindOneThatTimesOutGetsItsBytesOnANewConnection) {
  const NetnsHosts& hosts = *hosts_;
  constexpr size_t kBig = size_t{48} << 20;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    if (ctx.rank == 0) {
      Served served(ctx, kBig);
      ctx.store->get("fetched", kPatience);
      // The broken connection's session ends; the second one's stays while its reader does.
      awaitSessions(served.server, 1);
      ctx.store->set("sessions", Bytes{1});
      return;
    }
    Reader reader(ctx);
    std::vector<uint8_t> hasty(kBig), patient(kBig);
    const std::vector<ByteRange> all{{0, kBig}};
    std::string timedOut;
    std::atomic<bool> started{false};
    std::thread first([&] {
      started = true;
      try {
        reader.fetcher.fetch(reader.address, 1000, reader.source, 2, all, hasty.data(),
                             hasty.size(), Clock::now() + std::chrono::milliseconds(20));
      } catch (const Error& e) {
        timedOut = e.code() == ErrorCode::kTimeout ? "yes" : e.what();
      }
    });
    while (!started) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the first holds the connection
    const auto outcome = reader.fetch(2, all, patient);
    first.join();
    LOOM_CHECK(timedOut == "yes", << "the first fetch: " << timedOut);
    LOOM_CHECK(outcome.state == SourceState::kWhole && outcome.unchanged);
    expectPattern(patient, all, 2);
    // The broken connection is forgotten (the second's stays, unless a loaded machine ran
    // the second first, on the connection the first then broke).
    LOOM_CHECK(reader.fetcher.connections() <= 1, << reader.fetcher.connections());
    ctx.store->set("fetched", Bytes{1});
    ctx.store->get("sessions", kPatience);
  });
}

// A region whose bytes are staged a slice at a time, as the tensor store's device buffers
// are (torch_plugin/tensor_store_bindings.cc): into the session's staging.
class StagedSource final : public RegionLockedSource {
 public:
  using RegionLockedSource::RegionLockedSource;
  uint64_t capacity() const override { return region().capacity(); }
  std::span<const uint8_t> bytes(uint64_t offset, uint64_t length,
                                 std::unique_ptr<Staging>& staging) override {
    constexpr uint64_t kSlice = uint64_t{3} << 20;  // a Data message spans several windows' worth
    if (!staging) staging = std::make_unique<Slice>();
    auto& slice = static_cast<Slice&>(*staging).bytes;
    slice.resize(kSlice);
    const uint64_t n = std::min(kSlice, length);
    std::memcpy(slice.data(), region().data() + offset, n);
    return {slice.data(), n};
  }

 private:
  struct Slice final : Staging {
    std::vector<uint8_t> bytes;
  };
};

TEST_F(TwoHosts, ReadersOfOneStagedSourceAtOnceEachGetItsOwnBytes) {
  const NetnsHosts& hosts = *hosts_;
  constexpr size_t kBig = size_t{48} << 20;
  LOOM_RUN_RANKS(4, [&](RankContext& ctx) {
    hosts.enter(ctx.rank == 0 ? 0 : 1);
    if (ctx.rank == 0) {
      Served served(ctx, 4096);
      const std::shared_ptr<shm::Region> region = shm::Region::create(kBig);
      region->beginWrite();
      fill(*region, 2);
      LOOM_CHECK(region->endWrite() == 2);
      served.server.publish(region->id(), std::make_shared<StagedSource>(region));
      ctx.store->set("staged", Bytes(region->id().begin(), region->id().end()));
      for (int r = 1; r < 4; ++r) ctx.store->get("done " + std::to_string(r), kPatience);
      return;
    }
    Reader reader(ctx);
    const Bytes s = ctx.store->get("staged", kPatience);
    SourceId staged{};
    std::memcpy(staged.data(), s.data(), staged.size());
    // Each reader starts at its own offset, so a slice staged for another lands at the wrong
    // place and shows.
    const uint64_t split = kBig / 4 * static_cast<uint64_t>(ctx.rank - 1) + 4096;
    const std::vector<ByteRange> tail{{split, kBig - split}}, head{{0, split}};
    std::vector<uint8_t> dst(kBig);
    for (int round = 0; round < 3; ++round) {
      for (const auto& ranges : {tail, head}) {
        std::fill(dst.begin(), dst.end(), 0);
        const auto outcome = reader.fetch(2, ranges, dst, staged);
        LOOM_CHECK(outcome.state == SourceState::kWhole && outcome.unchanged);
        expectPattern(dst, ranges, 2);
      }
    }
    ctx.store->set("done " + std::to_string(ctx.rank), Bytes{1});
  });
}

// A reader whose host vanishes (the link cut, then the process gone: no goodbye and no
// reset reach the server) idle after a fetch, or mid-reply over a slow link: its session ends
// after the server's quiet limit and lets go of the source it was sending (withdrawn, it
// was kept by the session alone). Both stayed open, the source held, for as long as the
// test looked (40 s).
void expectAVanishedReadersSessionToEnd(const NetnsHosts& hosts, bool midReply) {
  const size_t big = midReply ? size_t{64} << 20 : 4096;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    if (ctx.rank == 0) {
      if (midReply) hosts.shape(0, 0.1);  // 64 MiB take seconds: the cut lands mid-reply
      Served served(ctx, big, std::chrono::milliseconds(1500));
      ctx.store->get("reader gone", kPatience);
      hosts.cutBetween(0, 1);
      served.server.withdraw(served.region->id());
      awaitSessions(served.server, 0);
      // The session's reference to the source is gone with it (the server's was withdrawn).
      LOOM_CHECK(served.region.use_count() == 1, << served.region.use_count());
      return;
    }
    Reader reader(ctx);
    std::vector<uint8_t> dst(big);
    std::thread fetching;
    if (midReply) {
      fetching = std::thread([&] {
        try {
          reader.fetch(2, {{0, big}}, dst);
        } catch (const Error&) {
        }
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    } else {
      LOOM_CHECK(reader.fetch(2, {{0, big}}, dst).state == SourceState::kWhole);
    }
    ctx.store->set("reader gone", Bytes{1});
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the cut is in place
    _exit(0);  // its FIN cannot reach the server: as far as the server knows, the host is gone
  });
}

TEST_F(TwoHosts, AnIdleReaderWhoseHostVanishedCostsTheServerNothingForLong) {
  expectAVanishedReadersSessionToEnd(*hosts_, false);
}

TEST_F(TwoHosts, AReaderWhoseHostVanishedMidReplyCostsTheServerNothingForLong) {
  expectAVanishedReadersSessionToEnd(*hosts_, true);
}

// A fetch from a host that vanished mid-reply (the link cut) stops as soon as its caller
// sets its stop flag (a cancelled tensor-store read), not at its deadline, and gives up its
// connection, so the next fetch of that server does not wait behind it; a fetch waiting
// behind it for their connection stops when told, too. Both waited out their deadlines
// before (the reads' buffer locks held all that time).
TEST_F(TwoHosts, AFetchFromAVanishedHostStopsWhenToldAndGivesUpItsConnection) {
  const NetnsHosts& hosts = *hosts_;
  constexpr size_t kBig = size_t{64} << 20;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    if (ctx.rank == 0) {
      hosts.shape(0, 0.1);  // 64 MiB take seconds: the cut lands mid-reply
      Served served(ctx, kBig, std::chrono::milliseconds(1500));
      ctx.store->get("fetching", kPatience);
      hosts.cutBetween(0, 1);
      ctx.store->set("cut", Bytes{1});
      ctx.store->get("stopped", kPatience);
      awaitSessions(served.server, 0);  // its quiet limit (torn down sooner, it took 10 s more)
      return;
    }
    Reader reader(ctx);
    std::vector<uint8_t> dst(kBig);
    const std::vector<ByteRange> all{{0, kBig}};
    std::atomic<bool> stop{false}, firstEnded{false};
    std::string outcome;
    std::thread fetching([&] {
      try {
        reader.fetcher.fetch(reader.address, 1000, reader.source, 2, all, dst.data(), dst.size(),
                             Clock::now() + std::chrono::seconds(40), &stop);
        outcome = "fetched";
      } catch (const Error& e) {
        outcome = e.code() == ErrorCode::kAborted ? "stopped" : e.what();
      }
      firstEnded = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // under way
    ctx.store->set("fetching", Bytes{1});
    ctx.store->get("cut", kPatience);
    // A second fetch of that server waits behind the first for their connection: told to
    // stop, it stops too, the first still stalled.
    std::vector<uint8_t> other(kBig);
    std::atomic<bool> stopBehind{false};
    std::string behind;
    std::thread waiting([&] {
      try {
        reader.fetcher.fetch(reader.address, 1000, reader.source, 2, all, other.data(),
                             other.size(), Clock::now() + std::chrono::seconds(40), &stopBehind);
        behind = "fetched";
      } catch (const Error& e) {
        behind = e.code() == ErrorCode::kAborted ? "stopped" : e.what();
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // waiting behind the first
    stopBehind = true;
    waiting.join();
    LOOM_CHECK(behind == "stopped" && !firstEnded, << "the fetch behind: " << behind);
    stop = true;
    fetching.join();
    LOOM_CHECK(outcome == "stopped", << "the fetch: " << outcome);
    LOOM_CHECK(reader.fetcher.connections() == 0, << reader.fetcher.connections());
    ctx.store->set("stopped", Bytes{1});
  });
}

// A live reader whose idle session the server ended (its quiet limit) fetches again on a
// new connection, without an error.
TEST_F(TwoHosts, AReaderWhoseIdleSessionEndedFetchesOnANewConnection) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    if (ctx.rank == 0) {
      Served served(ctx, kCapacity, std::chrono::milliseconds(300));
      ctx.store->get("quiet", kPatience);
      awaitSessions(served.server, 0);
      ctx.store->set("ended", Bytes{1});
      ctx.store->get("fetched", kPatience);
      return;
    }
    Reader reader(ctx);
    std::vector<uint8_t> dst(kCapacity);
    const std::vector<ByteRange> all{{0, kCapacity}};
    LOOM_CHECK(reader.fetch(2, all, dst).state == SourceState::kWhole);
    ctx.store->set("quiet", Bytes{1});
    ctx.store->get("ended", kPatience);
    std::fill(dst.begin(), dst.end(), 0);
    const auto outcome = reader.fetch(2, all, dst);
    LOOM_CHECK(outcome.state == SourceState::kWhole && outcome.unchanged);
    expectPattern(dst, all, 2);
    ctx.store->set("fetched", Bytes{1});
  });
}

// A reader keeps no connection to a server that has gone: one that closed (its goodbye) and
// one whose process exited without a word are let go of when the reader next connects to a
// new server (before, every writer process a reader ever read kept two channels' buffers
// and 16 descriptors in it for good).
TEST_F(TwoHosts, AReaderLetsGoOfTheConnectionsOfServersThatLeft) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(3, [&](RankContext& ctx) {
    hosts.enter(ctx.rank == 1 ? 1 : 0);
    if (ctx.rank == 0) {
      {
        Served a(ctx, 4096, ByteServer::kQuietLimit, "a/");
        ctx.store->get("fetched b", kPatience);
      }  // closes, saying goodbye
      ctx.store->set("a closed", Bytes{1});
      Served c(ctx, 4096, ByteServer::kQuietLimit, "c/");
      ctx.store->get("fetched c", kPatience);
      return;
    }
    if (ctx.rank == 2) {
      Served b(ctx, 4096, ByteServer::kQuietLimit, "b/");
      const std::string pid = std::to_string(::getpid());
      ctx.store->set("b pid", Bytes(pid.begin(), pid.end()));
      ctx.store->get("fetched b", kPatience);
      _exit(0);  // no goodbye: the kernel closes its sockets
    }
    Reader reader(ctx, "a/");
    std::vector<uint8_t> dst(4096);
    const std::vector<ByteRange> all{{0, 4096}};
    LOOM_CHECK(reader.fetch(2, all, dst).state == SourceState::kWhole);
    reader.find(ctx, "b/");
    LOOM_CHECK(reader.fetch(2, all, dst).state == SourceState::kWhole);
    LOOM_CHECK(reader.fetcher.connections() == 2, << reader.fetcher.connections());
    ctx.store->set("fetched b", Bytes{1});
    ctx.store->get("a closed", kPatience);
    const Bytes b = ctx.store->get("b pid", kPatience);
    awaitExit(std::stoi(std::string(b.begin(), b.end())));
    // Time for the exited server's closed connection to reach this host.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    reader.find(ctx, "c/");
    std::fill(dst.begin(), dst.end(), 0);
    LOOM_CHECK(reader.fetch(2, all, dst).state == SourceState::kWhole);
    expectPattern(dst, all, 2);
    LOOM_CHECK(reader.fetcher.connections() == 1,
               << reader.fetcher.connections() << " connections; one server is left");
    ctx.store->set("fetched c", Bytes{1});
  });
}

}  // namespace
}  // namespace loom::net
