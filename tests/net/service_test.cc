// The process's acceptor across hosts: proven connections reach the communicator and traffic
// they announce (also when they come before the communicator is registered), and
// connections that do not prove the secret in time are dropped without holding up others, and
// channels given up on are closed.

#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "net_helpers.h"
#include "transport/net/net_service.h"

namespace loom::net {
namespace {

using namespace loom::net::testing;
using std::chrono::milliseconds;

// libfabric's PSM provider (libinfinipath) installs handlers for these as it loads, which
// print a backtrace and exit(1): Ctrl-C stopped interrupting and a kill read as exit 1.
// loom gives them their defaults back as it loads (fabric.cc). Checked in a child: a process
// that has opened the network refuses it in the children it forks afterwards, which would be
// every later test's ranks (the binary's tests run in one process outside ctest).
TEST(Fabric, LoadingItLeavesTheProcessSignalsAlone) {
  const pid_t checker = ::fork();
  ASSERT_GE(checker, 0);
  if (checker == 0) {
    (void)Fabric::instance();
    int bad = 0;
    for (const int sig : {SIGINT, SIGTERM, SIGSEGV, SIGABRT, SIGBUS, SIGILL}) {
      struct sigaction current {};
      if (::sigaction(sig, nullptr, &current) != 0) ::_exit(100);
      void* handler = (current.sa_flags & SA_SIGINFO) != 0
                          ? reinterpret_cast<void*>(current.sa_sigaction)
                          : reinterpret_cast<void*>(current.sa_handler);
      Dl_info where{};
      const bool found = handler != reinterpret_cast<void*>(SIG_DFL) &&
                         handler != reinterpret_cast<void*>(SIG_IGN) &&
                         ::dladdr(handler, &where) != 0 && where.dli_fname != nullptr;
      if (found && std::strstr(where.dli_fname, "infinipath") != nullptr) {
        std::fprintf(stderr, "signal %d is handled in %s\n", sig, where.dli_fname);
        ++bad;
      }
    }
    // A child of this process killed by SIGTERM must read as killed, not as exit 1.
    const pid_t child = ::fork();
    if (child < 0) ::_exit(101);
    if (child == 0) {
      ::raise(SIGTERM);
      ::_exit(3);
    }
    int status = 0;
    if (::waitpid(child, &status, 0) != child) ::_exit(102);
    if (!(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM)) {
      std::fprintf(stderr, "a child killed by SIGTERM ended with status %d\n", status);
      ++bad;
    }
    ::_exit(bad == 0 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(checker, &status, 0), checker);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

CommId commNumber(uint8_t n) {
  CommId id = kComm;
  id[15] = n;
  return id;
}

// Tells the peer rank where `service` takes connections (publishedAddress reads it).
void publishAddress(RankContext& ctx, const NetService& service) {
  ctx.store->set("address", Bytes(service.address().begin(), service.address().end()));
}

// Where the peer rank's service takes connections (publishAddress), waiting for it.
std::string publishedAddress(RankContext& ctx) {
  const Bytes address = ctx.store->get("address", kPatience);
  return std::string(address.begin(), address.end());
}

// Writes one message of `text` on `out`, driving the handshake first.
void writeText(SendChannel& out, const std::string& text) {
  uint64_t done = 0;
  const auto deadline = Clock::now() + kPatience;
  while (!out.write({7, text.size()}, reinterpret_cast<const uint8_t*>(text.data()), done)) {
    LOOM_CHECK(Clock::now() < deadline, << "could not send '" << text << "'");
  }
}

// Claims a channel from `service` (waiting for it) and reads its one message.
std::string readText(NetService& service, const CommId& comm, int sender, int receiver,
                     uint32_t channel) {
  const auto deadline = Clock::now() + kPatience;
  std::unique_ptr<ReceiveChannel> in;
  while (!(in = service.claim(comm, sender, receiver, channel))) {
    LOOM_CHECK(Clock::now() < deadline, << "channel " << channel << " never arrived");
    std::this_thread::sleep_for(milliseconds(1));
  }
  std::optional<Envelope> envelope;
  while (!(envelope = in->nextEnvelope())) LOOM_CHECK(Clock::now() < deadline);
  std::string text(envelope->bytes, '\0');
  size_t filled = 0;
  while (filled < text.size()) {
    LOOM_CHECK(Clock::now() < deadline);
    filled += in->read(text.data() + filled, text.size() - filled);
  }
  return text;
}

TEST_F(TwoHosts, ServiceRoutesEachProvenChannelToItsTraffic) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const ChannelShape shape{4096, 4};
    if (ctx.rank == 0) {
      NetService service(Fabric::instance(), NetService::Limits{});
      service.expect(commNumber(1), kSecret, shape);
      service.expect(commNumber(2), kSecret, shape);
      publishAddress(ctx, service);
      // Communicator 3 is registered only after its connection has arrived.
      ctx.store->get("sent", kPatience);
      std::this_thread::sleep_for(milliseconds(300));
      service.expect(commNumber(3), kSecret, shape);
      LOOM_CHECK(readText(service, commNumber(2), 1, 0, 0) == "two");
      LOOM_CHECK(readText(service, commNumber(1), 1, 0, 1) == "one, channel one");
      LOOM_CHECK(readText(service, commNumber(1), 1, 0, 0) == "one");
      LOOM_CHECK(readText(service, commNumber(3), 1, 0, 0) == "three, early");
      LOOM_CHECK(service.claim(commNumber(1), 1, 0, 0) == nullptr, << "handed out twice");
      LOOM_CHECK(service.refused() == 0, << service.refused() << " refused");
      ctx.store->set("read", Bytes{1});
      return;
    }
    const std::string to = publishedAddress(ctx);
    auto channel = [&](uint8_t comm, uint32_t number) {
      Hello hello = traffic(1, 0, number);
      hello.comm = commNumber(comm);
      return std::make_unique<SendChannel>(Fabric::instance(), to, hello, kSecret, shape);
    };
    auto three = channel(3, 0);
    auto one = channel(1, 0);
    auto oneOne = channel(1, 1);
    auto two = channel(2, 0);
    ctx.store->set("sent", Bytes{1});
    writeText(*one, "one");
    writeText(*two, "two");
    writeText(*oneOne, "one, channel one");
    writeText(*three, "three, early");
    ctx.store->get("read", kPatience);
  });
}

// A channel its receiver gave up on is closed, whether it arrives after that or was already
// filed, and never handed out; the others are unaffected.
TEST_F(TwoHosts, ServiceClosesChannelsGivenUpOnBeforeOrAfterTheyArrive) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const ChannelShape shape{4096, 4};
    if (ctx.rank == 0) {
      NetService service(Fabric::instance(), NetService::Limits{});
      service.expect(kComm, kSecret, shape);
      service.discard(kComm, 1, 0, 5);  // before it arrives
      publishAddress(ctx, service);
      LOOM_CHECK(readText(service, kComm, 1, 0, 6) == "kept");
      ctx.store->get("sent 7", kPatience);
      std::this_thread::sleep_for(milliseconds(200));  // filed by now, most likely
      service.discard(kComm, 1, 0, 7);
      ctx.store->get("closed", kPatience);
      LOOM_CHECK(
          service.claim(kComm, 1, 0, 5) == nullptr && service.claim(kComm, 1, 0, 7) == nullptr,
          << "a discarded channel was handed out");
      return;
    }
    const std::string to = publishedAddress(ctx);
    auto channel = [&](uint32_t number) {
      return std::make_unique<SendChannel>(Fabric::instance(), to, traffic(1, 0, number), kSecret,
                                           shape);
    };
    auto five = channel(5);
    auto six = channel(6);
    auto seven = channel(7);
    writeText(*six, "kept");  // five may be closed before a write gets through: none
    writeText(*seven, "given up later");
    ctx.store->set("sent 7", Bytes{1});
    // Closed by the service: each says goodbye.
    const auto deadline = Clock::now() + kPatience;
    while (!five->peerLeft() || !seven->peerLeft()) {
      LOOM_CHECK(Clock::now() < deadline, << "a discarded channel stayed open");
      five->progress();
      seven->progress();
      std::this_thread::sleep_for(milliseconds(1));
    }
    ctx.store->set("closed", Bytes{1});
  });
}

TEST_F(TwoHosts, ServiceDropsStrangersInTimeWithoutHoldingUpMembers) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const ChannelShape shape{4096, 4};
    if (ctx.rank == 0) {
      NetService::Limits limits;
      // Short enough to see each drop, long enough for a member on a loaded machine.
      limits.handshake = milliseconds(3000);
      limits.unexpectedHold = milliseconds(4000);
      NetService service(Fabric::instance(), limits);
      service.expect(kComm, kSecret, shape);
      publishAddress(ctx, service);
      LOOM_CHECK(readText(service, kComm, 1, 0, 0) == "member");
      ctx.store->get("strangers gone", kPatience);
      LOOM_CHECK(service.refused() == 3, << service.refused() << " refused, not 3");
      return;
    }
    const std::string to = publishedAddress(ctx);
    // A stranger that never speaks, one for a communicator nobody registers, one with junk.
    Rogue silent(to);
    Rogue unknown(to);
    Hello hello = traffic(1, 0);
    hello.comm[3] ^= 1;
    hello.nonce = freshNonce();
    const auto bytes = encodeHello(hello);
    unknown.send(bytes.data(), bytes.size());
    Rogue junk(to);
    const std::vector<uint8_t> noise(64, 0xee);
    junk.send(noise.data(), noise.size());
    // A member gets through while they wait.
    SendChannel member(Fabric::instance(), to, traffic(1, 0), kSecret, shape);
    writeText(member, "member");
    // Each stranger is dropped: junk at once, silence after 3 s, unknown after 4 s.
    junk.awaitClosed();
    silent.awaitClosed();
    unknown.awaitClosed();
    ctx.store->set("strangers gone", Bytes{1});
  });
}

// An acceptor of two slots that closes one to make room after `crowdedHold`, and holds
// handshakes and unknown communicators far longer than any test waits.
NetService::Limits twoSlots(milliseconds crowdedHold) {
  NetService::Limits limits;
  limits.maxPending = 2;
  limits.crowdedHold = crowdedHold;
  limits.handshake = milliseconds(60'000);
  limits.unexpectedHold = milliseconds(120'000);
  return limits;
}

// Every slot held by strangers, silent or (`namingUnknown`) each naming a communicator
// nobody registers (anyone can, without the secret): a member's connection waits in the
// listener's queue until the oldest stranger is closed to make room (after the crowded
// hold, not the handshake's 10 s or the unknown communicator's minute), and gets through.
void expectAMemberGetsPastStrangers(const NetnsHosts& hosts, bool namingUnknown) {
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const ChannelShape shape{4096, 4};
    if (ctx.rank == 0) {
      NetService service(Fabric::instance(), twoSlots(milliseconds(500)));
      service.expect(kComm, kSecret, shape);
      publishAddress(ctx, service);
      ctx.store->get("strangers waiting", kPatience);
      const auto start = std::chrono::steady_clock::now();
      LOOM_CHECK(readText(service, kComm, 1, 0, 0) == "member");
      LOOM_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(60),
                 << "the member waited for a stranger's hold");
      ctx.store->get("member through", kPatience);
      LOOM_CHECK(service.refused() >= 1, << "no stranger was closed to make room");
      return;
    }
    const std::string to = publishedAddress(ctx);
    std::vector<std::unique_ptr<Rogue>> strangers;
    for (int i = 0; i < 2; ++i) {
      strangers.push_back(std::make_unique<Rogue>(to));
      if (!namingUnknown) continue;
      Hello hello = traffic(1, 0);
      hello.comm[3] ^= static_cast<uint8_t>(1 + i);
      hello.nonce = freshNonce();
      const auto bytes = encodeHello(hello);
      strangers.back()->send(bytes.data(), bytes.size());
    }
    std::this_thread::sleep_for(std::chrono::seconds(1));  // both taken in before the member
    ctx.store->set("strangers waiting", Bytes{1});
    SendChannel member(Fabric::instance(), to, traffic(1, 0), kSecret, shape);
    writeText(member, "member");
    ctx.store->set("member through", Bytes{1});
  });
}

// Silent strangers' connections used to be accepted and dropped at once, failing the
// member's communicator.
TEST_F(TwoHosts, ServiceMakesRoomForAMemberWhenStrangersFillIt) {
  expectAMemberGetsPastStrangers(*hosts_, false);
}

// Those naming unknown communicators used to keep their minute, and a stranger renewing them
// held every slot of the service, stalling every new connection of the job.
TEST_F(TwoHosts, ServiceMakesRoomForAMemberWhenStrangersNamingUnknownCommunicatorsFillIt) {
  expectAMemberGetsPastStrangers(*hosts_, true);
}

// A member in its handshake (its Hello answered, its proof not sent yet: a stalled
// initiator, which only moves its handshake on when its thread polls) while strangers fill
// the acceptor: the strangers make room, the member stays and is proven once its proof
// comes. The member used to be closed first, being the oldest, and its initiator, holding
// the reply and sending its proof, read the closing as its peer lost.
TEST_F(TwoHosts, ServiceNeverClosesAMemberInItsHandshakeToMakeRoom) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const ChannelShape shape{4096, 4};
    if (ctx.rank == 0) {
      NetService service(Fabric::instance(), twoSlots(milliseconds(300)));
      service.expect(kComm, kSecret, shape);
      publishAddress(ctx, service);
      ctx.store->get("proof sent", kPatience);
      const auto deadline = std::chrono::steady_clock::now() + kPatience;
      std::unique_ptr<ReceiveChannel> proven;
      while (!proven && std::chrono::steady_clock::now() < deadline) {
        proven = service.claim(kComm, 1, 0, 0);
        std::this_thread::sleep_for(milliseconds(1));
      }
      LOOM_CHECK(proven != nullptr, << "the member in its handshake was closed to make room");
      LOOM_CHECK(service.refused() >= 1, << "no stranger was closed to make room");
      ctx.store->set("claimed", Bytes{1});
      return;
    }
    const std::string to = publishedAddress(ctx);
    Rogue member(to);
    Hello mine = traffic(1, 0);
    mine.nonce = freshNonce();
    const auto hello = encodeHello(mine);
    member.send(hello.data(), hello.size());
    const auto theirs = member.awaitReply();
    LOOM_CHECK(theirs.has_value(), << "the acceptor did not answer the member");
    // The member holds one slot, a stranger the other; a second stranger is taken in (its
    // constructor returns once accepted) only when one of the two is closed.
    Rogue first(to);
    Rogue second(to);
    const auto proof = encodeProof(makeProof(kSecret, Role::kInitiator, mine, *theirs));
    member.send(proof.data(), proof.size());
    ctx.store->set("proof sent", Bytes{1});
    ctx.store->get("claimed", kPatience);
  });
}

// Strangers that connect and say nothing, more than the acceptor's open-file limit holds (an
// accepted connection holds several descriptors: libfabric's endpoint, its queues and
// sockets): the service keeps its unproven connections within a share of that limit, so a
// member's connection still gets through and the process can still open files of its own.
// (40 silent strangers at a limit of 160 used them all up: the member was refused.)
TEST_F(TwoHosts, ServiceLeavesDescriptorsForMembersWhenStrangersCrowdIt) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const ChannelShape shape{4096, 4};
    if (ctx.rank == 0) {
      rlimit files{};
      LOOM_CHECK(::getrlimit(RLIMIT_NOFILE, &files) == 0);
      files.rlim_cur = 160;
      LOOM_CHECK(::setrlimit(RLIMIT_NOFILE, &files) == 0);
      NetService::Limits limits;
      limits.crowdedHold = milliseconds(200);
      NetService service(Fabric::instance(), limits);
      service.expect(kComm, kSecret, shape);
      publishAddress(ctx, service);
      ctx.store->get("strangers waiting", kPatience);
      LOOM_CHECK(readText(service, kComm, 1, 0, 0) == "member");
      const int file = ::open("/dev/null", O_RDONLY);
      LOOM_CHECK(file >= 0, << "no descriptor left: " << std::strerror(errno));
      ::close(file);
      ctx.store->get("member through", kPatience);
      return;
    }
    const std::string to = publishedAddress(ctx);
    std::vector<std::unique_ptr<Endpoint>> strangers;
    for (int i = 0; i < 40; ++i) {
      strangers.push_back(Fabric::instance().connect(to));
      strangers.back()->start();
    }
    // Driven until taken in (their connection requests go out as they are polled), before
    // the member.
    const auto until = Clock::now() + std::chrono::seconds(1);
    while (Clock::now() < until) {
      for (auto& stranger : strangers) {
        try {
          (void)stranger->connected();
        } catch (const Error&) {
        }
      }
    }
    ctx.store->set("strangers waiting", Bytes{1});
    SendChannel member(Fabric::instance(), to, traffic(1, 0), kSecret, shape);
    writeText(member, "member");
    ctx.store->set("member through", Bytes{1});
  });
}

// Drives `out` until its peer's service closes the connection before answering its Hello
// (TurnedAway); fails if the channel is proven instead (its frames would be taken and lost).
void expectTurnedAway(SendChannel& out, const std::string& what) {
  const auto deadline = Clock::now() + kPatience;
  try {
    while (!out.ready()) {
      LOOM_CHECK(Clock::now() < deadline, << what << " was held, not turned away");
      std::this_thread::sleep_for(milliseconds(1));
    }
  } catch (const TurnedAway&) {
    return;
  }
  LOOM_CHECK(false, << what << " was taken in: a message on it would be lost");
}

// A rank that shut its communicator down (forget) takes no more connections: one made to it
// afterwards, before its peers have heard it left, is turned away at once, while other ranks
// of its process that still use the communicator take theirs. Such connections used to be
// proven and filed where nobody would claim them, so a small send on one "succeeded" and its
// message was lost (or, once no rank here used it, held for the unexpected hold).
TEST_F(TwoHosts, ServiceTurnsAwayConnectionsToARankThatLeft) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const ChannelShape shape{4096, 4};
    if (ctx.rank == 0) {
      NetService::Limits limits;
      limits.unexpectedHold = milliseconds(600'000);  // a held connection would outlast kPatience
      NetService service(Fabric::instance(), limits);
      service.expect(kComm, kSecret, shape);  // ranks 0 and 2 of the communicator live here
      service.expect(kComm, kSecret, shape);
      service.forget(kComm, 0);
      publishAddress(ctx, service);
      LOOM_CHECK(readText(service, kComm, 1, 2, 0) == "to the rank that stays");
      ctx.store->get("turned away while rank 2 stays", kPatience);
      service.forget(kComm, 2);
      ctx.store->set("rank 2 left", Bytes{1});
      ctx.store->get("turned away once all left", kPatience);
      LOOM_CHECK(service.claim(kComm, 1, 0, 0) == nullptr && service.expecting() == 0);
      return;
    }
    const std::string to = publishedAddress(ctx);
    SendChannel toLeft(Fabric::instance(), to, traffic(1, 0), kSecret, shape);
    SendChannel toStaying(Fabric::instance(), to, traffic(1, 2), kSecret, shape);
    writeText(toStaying, "to the rank that stays");
    expectTurnedAway(toLeft, "a connection to rank 0, which left");
    ctx.store->set("turned away while rank 2 stays", Bytes{1});
    ctx.store->get("rank 2 left", kPatience);
    SendChannel toLastLeft(Fabric::instance(), to, traffic(1, 2, 1), kSecret, shape);
    expectTurnedAway(toLastLeft, "a connection to rank 2, the last of its process to leave");
    ctx.store->set("turned away once all left", Bytes{1});
  });
}

}  // namespace
}  // namespace loom::net
