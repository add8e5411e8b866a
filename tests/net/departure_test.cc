// A rank on one host shuts its communicator down while its handle lives (torch's
// destroy_process_group while Python holds the group): whatever its peer on the other host asks
// of it next, a collective, a broadcast that only sends to it, a receive or a send, names it at
// once as having destroyed its communicator, not at the timeout; so too where the one that
// left or the one that asks holds no control link (a host's ranks beyond its rails).

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "net_helpers.h"

namespace loom {
namespace {

using loom::testing::NetnsHosts;
using loom::testing::RankContext;
using net::testing::TwoHosts;

// What rank 0 asks of a rank 1 that shut down.
enum class AskOfTheLeft { kAllReduce, kBroadcastFromHere, kReceive, kSend };

// Rank 1 shuts its communicator down while its handle lives (torch's destroy_process_group
// while Python holds the group), after a first barrier or before any collective: rank 0's
// call (`ask`) names it at once, not at the timeout.
void expectAPeerThatShutsDownIsNamed(const NetnsHosts& hosts, bool barrierFirst,
                                     AskOfTheLeft ask = AskOfTheLeft::kAllReduce) {
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    CommOptions options;
    options.timeout = std::chrono::seconds(60);
    auto comm = ctx.connect(options);
    if (barrierFirst) comm->barrier().wait();
    if (ctx.rank == 1) {
      comm->shutdown();
      ctx.store->set("rank 1 left", {1});
      ctx.store->get("rank 0 failed", std::chrono::seconds(120));
      return;
    }
    float x = 1;
    std::vector<uint8_t> large(size_t{64} << 20, 1);
    if (ask == AskOfTheLeft::kSend) {
      // A send completes once its bytes are in the link: made right after rank 1 left, before
      // its goodbye on the control link can have arrived, its connection must be refused (a
      // service that took it let the message in, and it was lost).
      ctx.store->get("rank 1 left", std::chrono::seconds(60));
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      switch (ask) {
        case AskOfTheLeft::kAllReduce:
          comm->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum).wait();
          break;
        case AskOfTheLeft::kBroadcastFromHere:  // it only sends: no receive waits on rank 1
          comm->broadcast(large.data(), large.data(), large.size(), DataType::kUInt8, 0).wait();
          break;
        case AskOfTheLeft::kReceive: comm->recv(&x, 1, DataType::kFloat32, 1, 7).wait(); break;
        case AskOfTheLeft::kSend:  // small: it "succeeded", the message lost
          comm->send(&x, 1, DataType::kFloat32, 1, 7).wait();
          break;
      }
      LOOM_CHECK(false, << "a call with a rank that shut down succeeded");
    } catch (const Error& e) {
      // Named as a peer gone, or as the calls it did not issue: either way, now and by name.
      LOOM_CHECK(e.code() == ErrorCode::kPeerFailure || e.code() == ErrorCode::kMismatch,
                 << e.what());
      LOOM_CHECK(std::string(e.what()).find("rank 1") != std::string::npos &&
                     std::string(e.what()).find("destroyed its communicator") != std::string::npos,
                 << e.what());
    }
    ctx.store->set("rank 0 failed", {1});
    LOOM_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30),
               << "named only at the timeout");
  });
}

// Its network links stayed open until the handle went: the peer waited out its timeout.
TEST_F(TwoHosts, APeerThatShutsDownIsNamedAcrossHostsWhileItsHandleLives) {
  expectAPeerThatShutsDownIsNamed(*hosts_, true);
}

// Before any collective no collective link exists to carry the goodbye: rank 0 learns of it
// from the control link (its peers waited out the whole timeout).
TEST_F(TwoHosts, APeerThatShutsDownBeforeAnyCollectiveIsNamedAcrossHosts) {
  expectAPeerThatShutsDownIsNamed(*hosts_, false);
}

// The same where rank 0's first word to it is a broadcast it roots (it waits for no receive),
// a receive or a small send: the links they open reach a rank that has left, whose service
// still takes them (a receive and a broadcast waited out the timeout; the send succeeded and
// its message was lost). The control link's goodbye is what names it: the send is made once
// that has arrived (see expectAPeerThatShutsDownIsNamed).
TEST_F(TwoHosts, APeerThatShutsDownIsNamedByABroadcastThatOnlySendsToIt) {
  expectAPeerThatShutsDownIsNamed(*hosts_, false, AskOfTheLeft::kBroadcastFromHere);
}

TEST_F(TwoHosts, APeerThatShutsDownIsNamedByAReceiveFromIt) {
  expectAPeerThatShutsDownIsNamed(*hosts_, true, AskOfTheLeft::kReceive);
}

TEST_F(TwoHosts, APeerThatShutsDownIsNamedByASendToIt) {
  expectAPeerThatShutsDownIsNamed(*hosts_, true, AskOfTheLeft::kSend);
}

// Three ranks on two hosts, one of them with two: rank `leaving` shuts down before any
// traffic, and rank `asking` (on the other host) then receives from it or sends to it. Where
// either holds no control link (local index 1: the hosts have one rail), its goodbye reached
// only a rail rank's process: the call waited out its timeout ("the receiver is not
// draining its channel" for the send).
void expectARankBeyondTheRailsToBeNamed(const NetnsHosts& hosts, const std::vector<int>& hostOf,
                                        int leaving, int asking, bool send) {
  LOOM_RUN_RANKS(3, [&](RankContext& ctx) {
    hosts.enter(hostOf[static_cast<size_t>(ctx.rank)]);
    CommOptions options;
    options.timeout = std::chrono::seconds(60);
    auto comm = ctx.connect(options);
    if (ctx.rank == leaving) {
      comm->shutdown();
      ctx.store->set("left", {1});
    }
    if (ctx.rank != asking) {
      ctx.store->get("asked", std::chrono::seconds(120));
      return;
    }
    ctx.store->get("left", std::chrono::seconds(60));
    float x = 1;
    const auto start = std::chrono::steady_clock::now();
    try {
      if (send) {
        comm->send(&x, 1, DataType::kFloat32, leaving, 7).wait();
      } else {
        comm->recv(&x, 1, DataType::kFloat32, leaving, 7).wait();
      }
      LOOM_CHECK(
          false, << "a " << (send ? "send to" : "receive from") << " a rank that left succeeded");
    } catch (const Error& e) {
      const std::string what = e.what();
      LOOM_CHECK(what.find("rank " + std::to_string(leaving)) != std::string::npos &&
                     what.find("destroyed its communicator") != std::string::npos,
                 << what);
    }
    ctx.store->set("asked", {1});
    LOOM_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30),
               << "named only at the timeout");
  });
}

// Ranks 0 1 | 2: rank 1 holds no control link; rank 2's goodbye came to rank 0's process.
TEST_F(TwoHosts, ARankWithoutAControlLinkNamesARailRankThatLeft) {
  expectARankBeyondTheRailsToBeNamed(*hosts_, {0, 0, 1}, 2, 1, false);
  expectARankBeyondTheRailsToBeNamed(*hosts_, {0, 0, 1}, 2, 1, true);
}

// Ranks 0 | 1 2: rank 2 holds no control link to say its goodbye on; its host's rail rank
// tells the other hosts.
TEST_F(TwoHosts, ARankWithoutAControlLinkThatLeftIsNamedOnOtherHosts) {
  expectARankBeyondTheRailsToBeNamed(*hosts_, {0, 1, 1}, 2, 0, false);
  expectARankBeyondTheRailsToBeNamed(*hosts_, {0, 1, 1}, 2, 0, true);
}

}  // namespace
}  // namespace loom
