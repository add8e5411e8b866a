// LOOM_* parsing: sizes, the algorithm table, and the handshake and roster codecs.

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <initializer_list>

#include "algorithms/selection.h"
#include "core/bootstrap.h"
#include "core/config.h"
#include "core/handshake.h"
#include "core/topology.h"
#include "loom/error.h"
#include "util/env.h"

namespace loom {
namespace {

TEST(Env, ParsesByteSizes) {
  EXPECT_EQ(env::parseBytes("4096"), 4096u);
  EXPECT_EQ(env::parseBytes("64K"), 65536u);
  EXPECT_EQ(env::parseBytes("1M"), 1u << 20);
  EXPECT_EQ(env::parseBytes("2G"), 2ull << 30);
  EXPECT_FALSE(env::parseBytes("").has_value());
  EXPECT_FALSE(env::parseBytes("12Q").has_value());
  EXPECT_FALSE(env::parseBytes("-1").has_value());
  EXPECT_FALSE(env::parseBytes("99999999999999999999G").has_value());
}

TEST(Env, RejectsMalformedValuesByName) {
  ::setenv("LOOM_TEST_INT", "abc", 1);
  try {
    env::integer("LOOM_TEST_INT", 1, 0, 10);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("LOOM_TEST_INT=abc"), std::string::npos);
  }
  ::setenv("LOOM_TEST_INT", "11", 1);
  EXPECT_THROW(env::integer("LOOM_TEST_INT", 1, 0, 10), Error);
  ::setenv("LOOM_TEST_INT", "7", 1);
  EXPECT_EQ(env::integer("LOOM_TEST_INT", 1, 0, 10), 7);
  ::unsetenv("LOOM_TEST_INT");
  EXPECT_EQ(env::integer("LOOM_TEST_INT", 1, 0, 10), 1);
}

TEST(Env, SwitchesTakeTheUsualSpellingsAndRejectTheRest) {
  for (const char* on : {"1", "true", "YES", "On"}) {
    ::setenv("LOOM_TEST_FLAG", on, 1);
    EXPECT_TRUE(env::flag("LOOM_TEST_FLAG")) << on;
  }
  for (const char* off : {"0", "false", "no", "OFF"}) {
    ::setenv("LOOM_TEST_FLAG", off, 1);
    EXPECT_FALSE(env::flag("LOOM_TEST_FLAG")) << off;
  }
  ::setenv("LOOM_TEST_FLAG", "maybe", 1);
  try {
    env::flag("LOOM_TEST_FLAG");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("LOOM_TEST_FLAG=maybe is not a switch"),
              std::string::npos);
  }
  ::unsetenv("LOOM_TEST_FLAG");
  EXPECT_FALSE(env::flag("LOOM_TEST_FLAG"));
}

TEST(SelectionTable, DefaultsSwitchBySize) {
  const SelectionTable table;
  EXPECT_EQ(table.allReduce(8), Algorithm::kOneShot);
  EXPECT_EQ(table.allReduce(size_t{256} << 20), Algorithm::kTwoShot);
}

TEST(SelectionTable, MoreRanksOnAHostSwitchToTwoShotSooner) {
  EXPECT_EQ(SelectionTable(2).allReduce(4096), Algorithm::kOneShot);
  EXPECT_EQ(SelectionTable(2).allReduce(4097), Algorithm::kTwoShot);
  EXPECT_EQ(SelectionTable(4).allReduce(1024), Algorithm::kOneShot);
  EXPECT_EQ(SelectionTable(4).allReduce(2048), Algorithm::kTwoShot);
  EXPECT_EQ(SelectionTable(16).allReduce(256), Algorithm::kOneShot);
  EXPECT_EQ(SelectionTable(16).allReduce(512), Algorithm::kTwoShot);
  // LOOM_ALGO entries replace the defaults of the operations they name, and only those.
  const auto table = SelectionTable::parse("reduce:two_shot:inf", SelectionTable(16));
  EXPECT_EQ(table.allReduce(512), Algorithm::kTwoShot);
  EXPECT_EQ(table.reduce(8), Algorithm::kTwoShot);
}

TEST(SelectionTable, ParsesOverrides) {
  const auto table =
      SelectionTable::parse("all_reduce:one_shot:1K,two_shot:inf;reduce:two_shot:inf");
  EXPECT_EQ(table.allReduce(1024), Algorithm::kOneShot);
  EXPECT_EQ(table.allReduce(1025), Algorithm::kTwoShot);
  EXPECT_EQ(table.reduce(1), Algorithm::kTwoShot);
}

TEST(SelectionTable, RejectsBadSpecsWithTheReason) {
  for (const char* spec :
       {"all_reduce", "bogus:one_shot:inf", "all_reduce:three_shot:inf", "all_reduce:one_shot:1K",
        "all_reduce:one_shot:2K,two_shot:1K,one_shot:inf",
        "all_reduce:one_shot:xyz,two_shot:inf"}) {
    EXPECT_THROW(SelectionTable::parse(spec), Error) << spec;
  }
}

TEST(Handshake, HelloRoundTripsAndRejectsGarbage) {
  handshake::Hello hello;
  hello.comm[3] = 7;
  hello.secret[0] = 9;
  hello.rank = 5;
  hello.pid = 1234;
  const auto bytes = handshake::encodeHello(hello);
  const auto parsed = handshake::parseHello(bytes);
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(parsed->comm, hello.comm);
  EXPECT_EQ(parsed->secret, hello.secret);
  EXPECT_EQ(parsed->rank, 5);
  EXPECT_EQ(parsed->pid, 1234);
  auto bad = bytes;
  bad[0] ^= 1;  // magic
  EXPECT_FALSE(handshake::parseHello(bad).has_value());
  EXPECT_FALSE(handshake::parseHello(std::span<const uint8_t>(bytes).first(10)).has_value());
  EXPECT_TRUE(handshake::secretsEqual(hello.secret, hello.secret));
  EXPECT_FALSE(handshake::secretsEqual(hello.secret, handshake::Secret{}));
}

TEST(Bootstrap, RosterRoundTripsAndRejectsWrongSizes) {
  Roster roster;
  roster.id[0] = 1;
  for (int q = 0; q < 3; ++q) {
    PeerInfo peer;
    peer.pid = 100 + q;
    peer.hostname = "host";
    peer.address = "loom.addr." + std::to_string(q);
    peer.netLanes = static_cast<uint32_t>(q + 1);
    roster.peers.push_back(peer);
  }
  const Bytes bytes = encodeRoster(roster);
  const auto parsed = parseRoster(bytes, 3);
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(parsed->peers[2].address, "loom.addr.2");
  EXPECT_EQ(parsed->peers[1].pid, 101);
  EXPECT_EQ(parsed->peers[2].netLanes, 3u);
  EXPECT_FALSE(parseRoster(bytes, 4).has_value());
  for (size_t n = 0; n < bytes.size(); ++n) {
    EXPECT_FALSE(parseRoster(std::span<const uint8_t>(bytes).first(n), 3).has_value());
  }
  // A refusal travels in place of the peers, for any size; a peer's own refusal with it.
  Roster refused;
  refused.refusal = "rank 1 cannot join: LOOM_NET_LANES=8";
  const auto parsedRefusal = parseRoster(encodeRoster(refused), 3);
  ASSERT_TRUE(parsedRefusal.has_value());
  EXPECT_EQ(parsedRefusal->refusalCode, ErrorCode::kInvalidArgument);
  // Rank 0's giving up at its timeout keeps its code.
  Roster abandoned;
  abandoned.refusal = "rank 0 gave up";
  abandoned.refusalCode = ErrorCode::kTimeout;
  const auto parsedAbandoned = parseRoster(encodeRoster(abandoned), 3);
  ASSERT_TRUE(parsedAbandoned.has_value());
  EXPECT_EQ(parsedAbandoned->refusalCode, ErrorCode::kTimeout);
  EXPECT_EQ(parsedRefusal->refusal, refused.refusal);
  EXPECT_TRUE(parsedRefusal->peers.empty());
  roster.refusal = "peers and a refusal at once";
  EXPECT_FALSE(parseRoster(encodeRoster(roster), 3).has_value());
  PeerInfo refusing;
  refusing.refusal = "LOOM_CHUNK_BYTES must be a multiple of 4096";
  const auto peer = parsePeer(encodePeer(refusing));
  ASSERT_TRUE(peer.has_value());
  EXPECT_EQ(peer->refusal, refusing.refusal);
}

TEST(Config, DefaultChunkIsWholePagesForEveryRankCount) {
  // 16 MiB / P must be rounded to pages: P = 5, 6, 7 once made create fail.
  for (int ranks = 1; ranks <= 64; ++ranks) {
    const Config config = Config::load(ranks);
    EXPECT_EQ(config.chunkBytes % 4096, 0u) << ranks << " ranks";
    EXPECT_GE(config.chunkBytes, size_t{1} << 20) << ranks << " ranks";
  }
}

// A slot is cut into one region per rank of the host, each at least a cache line: a chunk
// too small for the ranks is refused by name (it used to let the regions run past the slot).
TEST(Config, AChunkTooSmallForTheRanksOfAHostIsRefused) {
  ::setenv("LOOM_CHUNK_BYTES", "16K", 1);
  EXPECT_EQ(Config::load(256).chunkBytes, size_t{16} << 10);
  try {
    Config::load(300);
    ADD_FAILURE() << "a 16 KiB chunk for 300 ranks was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("set it to at least 20480"), std::string::npos)
        << e.what();
  }
  ::unsetenv("LOOM_CHUNK_BYTES");
}

TEST(Config, ThreadsShareTheMachinesCoresWithEveryRankOnItAndTheNetworkThreads) {
  ::unsetenv("LOOM_THREADS");
  const int cores = availableCores();
  auto threads = [](Config::Sharing sharing) { return Config::load(sharing).tuning.threads; };
  EXPECT_EQ(threads({1, 1, false}), std::min(cores, 8));
  EXPECT_EQ(threads({4, 4, false}), std::clamp(cores / 4, 1, 8));  // four ranks of one host
  // Across hosts each rank leaves two cores' worth per lane to its send and rail threads;
  // and two ranks here with two in another network namespace of this kernel share its
  // cores by four.
  EXPECT_EQ(threads({1, 1, true}), std::clamp(cores - 2, 1, 8));
  EXPECT_EQ(threads({1, 1, true, 2}), std::clamp(cores - 4, 1, 8));
  EXPECT_EQ(threads({2, 4, true}), std::clamp(cores / 4 - 2, 1, 8));
  EXPECT_EQ(threads({64, 64, true}), 1);
  ::setenv("LOOM_THREADS", "3", 1);
  EXPECT_EQ(threads({2, 4, true}), 3);  // what the user asks for wins
  ::unsetenv("LOOM_THREADS");
}

TEST(Config, WaitsSpinOnlyWhereEveryRankOnTheseCoresCanHaveOne) {
  ::unsetenv("LOOM_SPIN_US");
  ::unsetenv("LOOM_YIELD_US");
  const int cores = availableCores();
  auto spin = [](Config::Sharing sharing) { return Config::load(sharing).backoff.spin; };
  using std::chrono::microseconds;
  EXPECT_EQ(spin({1, 1, false, 1, 1}), microseconds(20));
  EXPECT_EQ(spin({cores, cores, false, 1, cores}), microseconds(20));  // a core each
  EXPECT_EQ(spin({cores + 1, cores + 1, false, 1, cores + 1}), microseconds(0));
  EXPECT_EQ(Config::load(cores + 1).backoff.spin, microseconds(0));
  // Ranks of this host bound to CPU sets of their own do not count: only those on this
  // rank's own CPUs, which other network namespaces' ranks may share too.
  EXPECT_EQ(spin({cores + 1, cores + 1, false, 1, 1}), microseconds(20));
  EXPECT_EQ(spin({1, cores + 1, true, 1, cores + 1}), microseconds(0));
  // A child's members share the cores with the parent's other processes still.
  const Config::Sharing crowded{cores + 1, cores + 1, false, 1, cores + 1};
  EXPECT_EQ(crowded.child(1, false).coreSharers, cores + 1);
  EXPECT_EQ(spin(crowded.child(1, false)), microseconds(0));
  // The yield stage is the same either way, and what the user asks for wins.
  EXPECT_EQ(Config::load(crowded).backoff.yield, microseconds(200));
  ::setenv("LOOM_SPIN_US", "7", 1);
  EXPECT_EQ(spin(crowded), microseconds(7));
  ::unsetenv("LOOM_SPIN_US");
}

TEST(Config, PeerReadsStartSoonerWithMoreRanksAndCanBeTurnedOff) {
  for (const char* name : {"LOOM_PEER_READS", "LOOM_PEER_READ_BYTES", "LOOM_PEER_READ_MAX_BYTES"}) {
    ::unsetenv(name);
  }
  // From 256 KiB with 8 or more ranks on the host, from 8 MiB with fewer; up to 32 MiB.
  EXPECT_EQ(Config::load(4).tuning.peerReadBytes, size_t{8} << 20);
  EXPECT_EQ(Config::load(7).tuning.peerReadBytes, size_t{8} << 20);
  EXPECT_EQ(Config::load(8).tuning.peerReadBytes, size_t{256} << 10);
  EXPECT_EQ(Config::load(16).tuning.peerReadMaxBytes, size_t{32} << 20);
  ::setenv("LOOM_PEER_READ_BYTES", "1M", 1);
  EXPECT_EQ(Config::load(16).tuning.peerReadBytes, size_t{1} << 20);
  ::setenv("LOOM_PEER_READS", "0", 1);
  EXPECT_EQ(Config::load(16).tuning.peerReadBytes, SIZE_MAX);  // off, whatever the size
  ::setenv("LOOM_PEER_READS", "2", 1);
  EXPECT_THROW(Config::load(16), Error);
  // Off, a malformed size is still an error (it was read only when on).
  ::setenv("LOOM_PEER_READS", "0", 1);
  ::setenv("LOOM_PEER_READ_BYTES", "garbage", 1);
  EXPECT_THROW(Config::load(16), Error);
  ::unsetenv("LOOM_PEER_READS");
  ::unsetenv("LOOM_PEER_READ_BYTES");
}

// Each of `values` for variable `name` makes Config::load fail with an error that names
// "name="; the variable is unset afterwards.
void expectEachRefusedNamingIt(const char* name, std::initializer_list<const char*> values) {
  for (const char* bad : values) {
    ::setenv(name, bad, 1);
    try {
      Config::load(2);
      ADD_FAILURE() << name << "=" << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(name) + "="), std::string::npos) << e.what();
    }
  }
  ::unsetenv(name);
}

TEST(Config, AFaultDrillsKillPointIsTwoCountsFromOne) {
  ::setenv("LOOM_FAULT_KILL_AT", "3:2", 1);
  const Config drill = Config::load(2);
  EXPECT_EQ(drill.killAt.seq, 3u);
  EXPECT_EQ(drill.killAt.phase, 2u);
  // Signs, spaces, overflow and trailing text were read as a kill point that never came.
  expectEachRefusedNamingIt("LOOM_FAULT_KILL_AT",
                            {"-1:1", " 1:-1", "1: 1", "99999999999999999999:1", "1:1x", "0:1",
                             "1:0", "1", ":", "1:", "+1:1", "a:b"});
}

TEST(Config, AFaultDrillsStallPointIsThreeCountsFromOne) {
  ::setenv("LOOM_FAULT_STALL_AT", "2:1:4500", 1);
  const Config drill = Config::load(2);
  EXPECT_EQ(drill.stallAt.seq, 2u);
  EXPECT_EQ(drill.stallAt.phase, 1u);
  EXPECT_EQ(drill.stallAt.pause, std::chrono::milliseconds(4500));
  expectEachRefusedNamingIt(
      "LOOM_FAULT_STALL_AT",
      {"2:1", "2:1:", "2:1:0", "0:1:5", "2:0:5", "2:1:5x", "2:1:-5", "2::5", "a:b:c", "2:1:5:6"});
}

TEST(Config, AChildTakesItsOwnHostLayoutAndTheParentsMachine) {
  ::unsetenv("LOOM_THREADS");
  ::unsetenv("LOOM_CHUNK_BYTES");
  const int cores = availableCores();
  // 8 ranks on this host and machine, across hosts; a child of 2 of them within this host.
  const Config::Sharing parent{8, 8, true};
  const Config::Sharing child = parent.child(2, false);
  EXPECT_EQ(child.localRanks, 2);
  EXPECT_EQ(child.machineRanks, 8);  // the other 6 processes still run here
  EXPECT_FALSE(child.spansHosts);
  const Config made = Config::load(child);
  EXPECT_EQ(made.sharing.localRanks, 2);
  // Chunks (and the algorithm table) for its 2 local ranks, not the parent's 8.
  EXPECT_EQ(made.chunkBytes, Config::load(2).chunkBytes);
  EXPECT_NE(made.chunkBytes, Config::load(parent).chunkBytes);
  // No network threads beside its helpers: the cores the parent left them come back.
  EXPECT_EQ(made.tuning.threads, std::clamp(cores / 8, 1, 8));
  EXPECT_EQ(Config::load(parent).tuning.threads, std::clamp(cores / 8 - 2, 1, 8));
  // A child that still spans hosts keeps them.
  EXPECT_EQ(Config::load(parent.child(3, true)).tuning.threads, std::clamp(cores / 8 - 2, 1, 8));
}

}  // namespace
}  // namespace loom
