#pragma once

// What the multi-host tests share: two namespace hosts per test, address exchange through
// the store, and a hand-driven initiator for sending what loom never would.

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>

#include "forked_ranks.h"
#include "loom/error.h"
#include "netns_hosts.h"
#include "transport/net/auth.h"
#include "transport/net/channel.h"

namespace loom::net::testing {

using loom::testing::NetnsHosts;
using loom::testing::RankContext;

using Clock = std::chrono::steady_clock;

inline constexpr auto kPatience = std::chrono::seconds(30);
inline const JobSecret kSecret{0x5e, 0xc2, 0xe7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
inline const CommId kComm{0xc0, 0xaa, 1};

inline Hello traffic(int sender, int receiver, uint32_t channel = 0) {
  Hello h;
  h.comm = kComm;
  h.sender = sender;
  h.receiver = receiver;
  h.channel = channel;
  return h;
}

// A lookup that knows one communicator.
inline SecretLookup expecting(const CommId& comm, const JobSecret& secret, ChannelShape shape) {
  return [comm, secret, shape](const Hello& h) -> std::optional<Expectation> {
    if (h.comm == comm) return Expectation{secret, shape};
    return std::nullopt;
  };
}

// Publishes this rank's fabric address and returns rank `peer`'s.
inline std::string exchangeAddresses(RankContext& ctx, int peer) {
  const std::string mine = Fabric::instance().address();
  ctx.store->set("address/" + std::to_string(ctx.rank), Bytes(mine.begin(), mine.end()));
  const Bytes theirs = ctx.store->get("address/" + std::to_string(peer), kPatience);
  return std::string(theirs.begin(), theirs.end());
}

// The next connection to this process, as a ReceiveChannel.
inline std::unique_ptr<ReceiveChannel> acceptOne(SecretLookup lookup) {
  const auto deadline = Clock::now() + kPatience;
  while (Clock::now() < deadline) {
    if (auto endpoint = Fabric::instance().acceptNext(std::chrono::milliseconds(10))) {
      return std::make_unique<ReceiveChannel>(std::move(endpoint), std::move(lookup));
    }
  }
  LOOM_CHECK(false, << "no connection arrived");
  return nullptr;
}

// `Count` hosts for each test (skipped without root, failed under LOOM_REQUIRE_NETNS).
template <int Count>
class HostsFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = NetnsHosts::unavailableReason();
    if (!reason.empty()) {
      if (std::getenv("LOOM_REQUIRE_NETNS")) FAIL() << reason;
      GTEST_SKIP() << reason;
    }
    hosts_ = std::make_unique<NetnsHosts>(Count);
  }
  std::unique_ptr<NetnsHosts> hosts_;
};
using TwoHosts = HostsFixture<2>;
using ThreeHosts = HostsFixture<3>;

// Ranks alternating between two hosts (0 and 2 on host 0, 1 and 3 on host 1), so a rank's
// index within its host differs from its rank.
inline int hostOfRank(int rank) {
  return rank % 2;
}

// A process that speaks the handshake itself, to send what loom never would.
class Rogue {
 public:
  explicit Rogue(const std::string& address) : endpoint_(Fabric::instance().connect(address)) {
    endpoint_->postReceive(reply_, sizeof reply_, nullptr);
    endpoint_->start();
    const auto deadline = Clock::now() + kPatience;
    while (!endpoint_->connected()) LOOM_CHECK(Clock::now() < deadline, << "rogue not connected");
  }
  void send(const void* bytes, size_t n) {
    LOOM_CHECK(endpoint_->inject(bytes, n), << "inject refused");
  }
  // Waits for the acceptor's reply (Hello + Proof).
  std::optional<Hello> awaitReply() {
    Completion done[4];
    const auto deadline = Clock::now() + kPatience;
    while (Clock::now() < deadline) {
      if (endpoint_->poll(done) > 0) return parseHello({reply_, kHelloBytes});
    }
    return std::nullopt;
  }
  // Waits for the acceptor's first message, whatever it is; returns its bytes.
  std::vector<uint8_t> awaitMessage() {
    Completion done[4];
    const auto deadline = Clock::now() + kPatience;
    while (Clock::now() < deadline) {
      const size_t n = endpoint_->poll(done);
      for (size_t i = 0; i < n; ++i) {
        if (done[i].isReceive) return {reply_, reply_ + done[i].length};
      }
    }
    LOOM_CHECK(false, << "the acceptor did not answer");
    return {};
  }
  // Waits until the acceptor closes the connection.
  void awaitClosed() {
    Completion done[4];
    const auto deadline = Clock::now() + kPatience;
    try {
      while (Clock::now() < deadline) endpoint_->poll(done);
    } catch (const Error&) {
      return;
    }
    LOOM_CHECK(false, << "the acceptor did not close the connection");
  }

 private:
  std::unique_ptr<Endpoint> endpoint_;
  uint8_t reply_[128] = {};
};

}  // namespace loom::net::testing
