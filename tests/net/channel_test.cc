// Network channels between processes on different hosts (network namespaces joined by a
// bridge): authenticated connections, messages intact both ways at every size around a
// frame boundary (copied or sent from the writer's memory, or while still being produced),
// refusals before any data, a peer that dies mid-message, and borrowed frames given up.

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "expect_error.h"
#include "net_helpers.h"
#include "transport/net/auth.h"
#include "transport/net/net_link.h"

namespace loom::net {
namespace {

using Clock = std::chrono::steady_clock;
using loom::testing::expectError;
using namespace loom::net::testing;

// Connects this rank and `peer` both ways; both ranks call it at once. `sending`, if given,
// receives the outbound channel (owned by the link).
std::unique_ptr<NetLink> linkWith(int me, int peer, const std::string& address, ChannelShape shape,
                                  uint32_t channel = 0, SendChannel** sending = nullptr) {
  auto out = std::make_unique<SendChannel>(Fabric::instance(), address, traffic(me, peer, channel),
                                           kSecret, shape);
  if (sending != nullptr) *sending = out.get();
  std::unique_ptr<ReceiveChannel> in;
  const auto deadline = Clock::now() + kPatience;
  for (;;) {
    LOOM_CHECK(Clock::now() < deadline, << "the link did not come up");
    if (!in) {
      if (auto endpoint = Fabric::instance().acceptNext(std::chrono::milliseconds(1))) {
        in =
            std::make_unique<ReceiveChannel>(std::move(endpoint), expecting(kComm, kSecret, shape));
      }
    }
    const bool outReady = out->ready();
    if (in && in->ready() && outReady) break;
  }
  LOOM_CHECK(in->announced().sender == peer && in->announced().receiver == me);
  return std::make_unique<NetLink>(std::move(out), std::move(in));
}

uint8_t patternByte(int sender, size_t message, size_t j) {
  return static_cast<uint8_t>((j * 131 + message * 7 + static_cast<size_t>(sender) * 29) ^
                              (j >> 9));
}

// `bytes` of `sender`'s pattern, as one message.
std::vector<uint8_t> patterned(int sender, size_t bytes) {
  std::vector<uint8_t> message(bytes);
  for (size_t j = 0; j < bytes; ++j) message[j] = patternByte(sender, 0, j);
  return message;
}

// The next message's envelope, once it has arrived (before `deadline`).
Envelope awaitEnvelope(MessageLink& link, Clock::time_point deadline) {
  std::optional<Envelope> envelope;
  while (!envelope) {
    LOOM_CHECK(Clock::now() < deadline, << "nothing arrived");
    envelope = link.nextEnvelope();
  }
  return *envelope;
}

// Sends `sizes` to the peer while receiving the peer's same list, and checks every byte;
// `mode` says whether the link may send from the messages' own memory (kept until drained).
void exchange(MessageLink& link, int me, int peer, const std::vector<size_t>& sizes,
              Payload mode = Payload::kCopied) {
  std::vector<std::vector<uint8_t>> outgoing;
  for (size_t i = 0; i < sizes.size(); ++i) {
    outgoing.emplace_back(sizes[i]);
    for (size_t j = 0; j < sizes[i]; ++j) outgoing[i][j] = patternByte(me, i, j);
  }
  size_t sent = 0, received = 0;
  uint64_t done = 0;
  std::optional<Envelope> incoming;
  std::vector<uint8_t> buffer;
  size_t filled = 0;
  const auto deadline = Clock::now() + kPatience;
  while (sent < sizes.size() || received < sizes.size()) {
    LOOM_CHECK(Clock::now() < deadline,
               << "stuck at message " << sent << " out, " << received << " in");
    if (sent < sizes.size()) {
      const Envelope envelope{static_cast<int>(sent) - 3, sizes[sent]};
      const bool handedOver = mode == Payload::kBorrowed
                                  ? link.writeBorrowed(envelope, outgoing[sent].data(), done)
                                  : link.write(envelope, outgoing[sent].data(), done);
      if (handedOver) {
        ++sent;
        done = 0;
      }
    }
    if (received < sizes.size() && !incoming) {
      incoming = link.nextEnvelope();
      if (incoming) {
        LOOM_CHECK(incoming->tag == static_cast<int>(received) - 3, << "tag " << incoming->tag);
        LOOM_CHECK(incoming->bytes == sizes[received], << "bytes " << incoming->bytes);
        buffer.assign(incoming->bytes, 0);
        filled = 0;
      }
    }
    if (incoming) {
      filled += link.read(buffer.data() + filled, buffer.size() - filled);
      if (filled == buffer.size()) {
        for (size_t j = 0; j < buffer.size(); ++j) {
          LOOM_CHECK(buffer[j] == patternByte(peer, received, j),
                     << "message " << received << " byte " << j);
        }
        ++received;
        incoming.reset();
      }
    }
  }
  while (!link.drained()) LOOM_CHECK(Clock::now() < deadline, << "the sends did not drain");
}

TEST_F(TwoHosts, MessagesArriveIntactBothWaysAcrossFrameBoundaries) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const int peer = 1 - ctx.rank;
    const std::string address = exchangeAddresses(ctx, peer);
    LOOM_CHECK(address.rfind(hosts.address(peer) + ":", 0) == 0, << address);
    // A small window (3 frames of 4 KiB) exercises credits; the default one, bulk. Each
    // goes copied, then sent from the writer's memory, where every frame that carries
    // payload is borrowed: the bytes must arrive the same.
    const ChannelShape small{4096, 3};
    const size_t room = small.frameBytes - kFrameHeaderBytes;
    const struct {
      ChannelShape shape;
      std::vector<size_t> sizes;
    } cases[] = {
        {small, {0, 1, 7, room - 1, room, room + 1, 0, 3 * room + 5, 100 * room, 1 << 20}},
        {ChannelShape{}, {size_t{16} << 20, 5, (size_t{8} << 20) + 3}},
    };
    uint32_t channel = 0;
    for (const Payload mode : {Payload::kCopied, Payload::kBorrowed}) {
      for (const auto& c : cases) {
        SendChannel* out = nullptr;
        auto link = linkWith(ctx.rank, peer, address, c.shape, channel++, &out);
        exchange(*link, ctx.rank, peer, c.sizes, mode);
        uint64_t payloadFrames = 0;
        const size_t frameRoom = c.shape.frameBytes - kFrameHeaderBytes;
        for (size_t size : c.sizes) payloadFrames += (size + frameRoom - 1) / frameRoom;
        const uint64_t want = mode == Payload::kBorrowed ? payloadFrames : 0;
        LOOM_CHECK(out->borrowedFrames() == want, << out->borrowedFrames() << " of " << want);
      }
    }
  });
}

// A message whose payload is still being produced (a ring passing each part on as it lands):
// a frame goes only once all of its bytes exist, so frames stay full, and the reader gets
// the message intact.
TEST_F(TwoHosts, APrefixWriteSendsOnlyWholeFramesOfWhatExists) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const int peer = 1 - ctx.rank;
    const std::string address = exchangeAddresses(ctx, peer);
    const ChannelShape shape{4096, 3};
    const size_t room = shape.frameBytes - kFrameHeaderBytes;
    SendChannel* out = nullptr;
    auto link = linkWith(ctx.rank, peer, address, shape, 0, &out);
    const size_t bytes = 3 * room + 5;
    const std::vector<uint8_t> message = patterned(1, bytes);
    const auto deadline = Clock::now() + kPatience;
    if (ctx.rank == 1) {
      exchange(*link, ctx.rank, peer, {1});  // the window is granted: credits are here
      uint64_t done = 0;
      // Writes until `done` reaches `want` (credits may lag), and checks it goes no further.
      const auto writeUpTo = [&](uint64_t produced, uint64_t want, bool whole) {
        bool handedOver = false;
        while (done < want) {
          LOOM_CHECK(Clock::now() < deadline, << "stuck at " << done << " of " << want);
          handedOver = link->writeBorrowedPrefix({5, bytes}, message.data(), done, produced);
        }
        for (int i = 0; i < 100 && !handedOver; ++i) {
          handedOver = link->writeBorrowedPrefix({5, bytes}, message.data(), done, produced);
        }
        LOOM_CHECK(done == want, << done << " handed over where " << want << " exist as frames");
        LOOM_CHECK(handedOver == whole);
      };
      writeUpTo(room - 1, 0, false);  // not one whole frame yet
      writeUpTo(room, room, false);
      writeUpTo(2 * room + 10, 2 * room, false);
      const auto before = out->borrowedFrames();
      writeUpTo(bytes, bytes, true);  // the rest, the short last frame included
      LOOM_CHECK(out->borrowedFrames() == before + 2, << out->borrowedFrames());
      while (!link->drained()) LOOM_CHECK(Clock::now() < deadline, << "the sends did not drain");
      return;
    }
    exchange(*link, ctx.rank, peer, {1});
    const Envelope envelope = awaitEnvelope(*link, deadline);
    LOOM_CHECK(envelope.tag == 5 && envelope.bytes == bytes, << envelope.bytes);
    std::vector<uint8_t> buffer(bytes);
    size_t filled = 0;
    while (filled < bytes) {
      LOOM_CHECK(Clock::now() < deadline, << "stuck at " << filled);
      filled += link->read(buffer.data() + filled, bytes - filled);
    }
    LOOM_CHECK(buffer == message, << "the message arrived changed");
  });
}

// What a ring's reducing step takes out of the link's own buffers (ArrivingReduction): peek
// shows the message's next bytes in place, at most a frame's and never past the message, and
// leaves them there until read() lets go of them; reads and peeks mix in any order.
TEST_F(TwoHosts, APeekShowsTheNextBytesInPlaceUntilAReadLetsGoOfThem) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const int peer = 1 - ctx.rank;
    const std::string address = exchangeAddresses(ctx, peer);
    const ChannelShape shape{4096, 3};
    const size_t room = shape.frameBytes - kFrameHeaderBytes;
    auto link = linkWith(ctx.rank, peer, address, shape, 0);
    const size_t bytes = 5 * room + 7;
    const std::vector<uint8_t> message = patterned(2, bytes);
    const auto deadline = Clock::now() + kPatience;
    exchange(*link, ctx.rank, peer, {1});
    if (ctx.rank == 1) {
      uint64_t done = 0;
      while (!link->write({9, bytes}, message.data(), done)) {
        LOOM_CHECK(Clock::now() < deadline, << "stuck writing at " << done);
      }
      exchange(*link, ctx.rank, peer, {2});  // a message after it: peeks never reach into it
      while (!link->drained()) LOOM_CHECK(Clock::now() < deadline, << "the sends did not drain");
      return;
    }
    const Envelope envelope = awaitEnvelope(*link, deadline);
    LOOM_CHECK(envelope.tag == 9 && envelope.bytes == bytes, << envelope.bytes);
    size_t taken = 0;
    for (int turn = 0; taken < bytes; ++turn) {
      LOOM_CHECK(Clock::now() < deadline, << "stuck at " << taken);
      const size_t want = bytes - taken;
      const std::span<const uint8_t> view = link->peek(want);
      if (view.empty()) continue;  // the next frame is not here yet
      LOOM_CHECK(view.size() <= std::min(want, room), << view.size() << " bytes at " << taken);
      LOOM_CHECK(std::memcmp(view.data(), message.data() + taken, view.size()) == 0,
                 << "a peek at byte " << taken << " shows other bytes");
      const std::span<const uint8_t> again = link->peek(want);
      LOOM_CHECK(again.data() == view.data() && again.size() == view.size(),
                 << "a second peek moved at byte " << taken);
      const std::span<const uint8_t> few = link->peek(3);
      LOOM_CHECK(few.data() == view.data() && few.size() == std::min<size_t>(3, view.size()),
                 << "a peek of 3 bytes at byte " << taken << " showed " << few.size());
      if (turn % 3 == 2) {  // a read takes the next bytes out instead
        std::vector<uint8_t> out(view.size());
        const size_t n = link->read(out.data(), out.size());
        LOOM_CHECK(n == out.size() && std::memcmp(out.data(), message.data() + taken, n) == 0,
                   << "a read after a peek at byte " << taken);
        taken += n;
        continue;
      }
      const size_t letGo = turn % 3 == 0 ? view.size() : view.size() / 2 + 1;
      LOOM_CHECK(link->read(nullptr, letGo) == letGo);
      taken += letGo;
    }
    LOOM_CHECK(link->peek(1).empty(), << "a peek past the message's end showed bytes");
    exchange(*link, ctx.rank, peer, {2});
  });
}

TEST_F(TwoHosts, AbandonedBorrowedFramesAreNeverReadAndThePeerSeesTheLinkClose) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const int peer = 1 - ctx.rank;
    const std::string address = exchangeAddresses(ctx, peer);
    // Four frames of 8 MiB: far more than the sockets buffer, so most stay queued while the
    // reader does not read.
    const ChannelShape shape{size_t{8} << 20, 4};
    SendChannel* out = nullptr;
    auto link = linkWith(ctx.rank, peer, address, shape, 0, &out);
    if (ctx.rank == 1) {
      const size_t bytes = size_t{64} << 20;
      void* memory =
          ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      LOOM_CHECK(memory != MAP_FAILED);
      std::memset(memory, 0x5a, bytes);
      uint64_t done = 0;
      const auto deadline = Clock::now() + kPatience;
      while (done < 4 * (shape.frameBytes - kFrameHeaderBytes)) {
        LOOM_CHECK(Clock::now() < deadline, << "stuck at " << done);
        LOOM_CHECK(!link->writeBorrowed({0, bytes}, static_cast<uint8_t*>(memory), done));
      }
      LOOM_CHECK(out->borrowedFrames() == 4, << out->borrowedFrames());
      link->drained();
      LOOM_CHECK(!link->drained(), << "32 MiB left through sockets nobody reads");
      // The writer gives the message up and takes its memory back: unmapped, so any later
      // read of it by the provider would crash this process.
      link->abandonSends();
      LOOM_CHECK(::munmap(memory, bytes) == 0);
      LOOM_CHECK(link->drained());
      expectError(
          [&] {
            link->writeBorrowed({1, 8}, nullptr, done);
          },
          ErrorCode::kPeerFailure, {"10.77.0.1", "gave up the frames"});
      ctx.store->set("abandoned", Bytes{1});
      ctx.store->get("told", kPatience);
      return;
    }
    ctx.store->get("abandoned", kPatience);
    std::vector<uint8_t> buffer(size_t{64} << 20);
    size_t filled = 0;
    const auto deadline = Clock::now() + kPatience;
    expectError(
        [&] {
          awaitEnvelope(*link, deadline);
          for (;;) {
            LOOM_CHECK(Clock::now() < deadline, << "the reader was not told");
            filled += link->read(buffer.data() + filled, buffer.size() - filled);
            LOOM_CHECK(filled < buffer.size(), << "a whole message after it was given up");
          }
        },
        ErrorCode::kPeerFailure, {"10.77.0.2", "closed"});
    for (size_t j = 0; j < filled; ++j) LOOM_CHECK(buffer[j] == 0x5a, << "byte " << j);
    ctx.store->set("told", Bytes{1});
  });
}

TEST_F(TwoHosts, RefusesEveryoneWithoutTheSecretBeforeAnyData) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const std::string address = exchangeAddresses(ctx, 1 - ctx.rank);
    const ChannelShape shape{4096, 4};
    if (ctx.rank == 0) {
      // The acceptor, three times: each refusal names what was wrong.
      auto refuse = [&](std::initializer_list<const char*> parts) {
        auto in = acceptOne(expecting(kComm, kSecret, shape));
        const auto deadline = Clock::now() + kPatience;
        expectError(
            [&] {
              while (!in->ready()) LOOM_CHECK(Clock::now() < deadline, << "no verdict");
            },
            ErrorCode::kPeerFailure, parts);
      };
      refuse({"did not open with a loom handshake"});
      refuse({"did not prove the job secret", "before any data"});
      refuse({"closed by the peer"});  // the honest initiator with the wrong secret hung up
      ctx.store->set("acceptor done", Bytes{1});
      return;
    }
    // 1. Bytes that are no handshake at all.
    {
      Rogue rogue(address);
      const std::vector<uint8_t> junk(50, 0x42);
      rogue.send(junk.data(), junk.size());
      rogue.awaitClosed();
    }
    // 2. A guessed proof, then a data frame right behind it: refused, the frame never read.
    {
      Rogue rogue(address);
      Hello hello = traffic(1, 0);
      hello.nonce = freshNonce();
      const auto bytes = encodeHello(hello);
      rogue.send(bytes.data(), bytes.size());
      const auto reply = rogue.awaitReply();
      LOOM_CHECK(reply.has_value(), << "the acceptor did not answer a valid Hello");
      JobSecret guess = kSecret;
      guess[0] ^= 0xff;
      const auto proof = encodeProof(makeProof(guess, Role::kInitiator, hello, *reply));
      rogue.send(proof.data(), proof.size());
      FrameHeader header;
      header.first = true;
      header.length = 8;
      header.envelope = {0, 8};
      uint8_t frame[kFrameHeaderBytes + 8] = {};
      encodeFrameHeader(header, frame);
      rogue.send(frame, sizeof frame);
      rogue.awaitClosed();
    }
    // 3. loom itself, with another job's secret: it refuses the acceptor's proof.
    {
      JobSecret other = kSecret;
      other[15] ^= 1;
      SendChannel out(Fabric::instance(), address, traffic(1, 0), other, shape);
      const auto deadline = Clock::now() + kPatience;
      expectError(
          [&] {
            while (!out.ready()) LOOM_CHECK(Clock::now() < deadline, << "no verdict");
          },
          ErrorCode::kPeerFailure, {"did not prove the job secret", "10.77.0.1"});
    }
    ctx.store->get("acceptor done", kPatience);
  });
}

// `bytes` (a Hello or a version note) as a build speaking wire version `version` makes them.
template <size_t N>
std::array<uint8_t, N> asVersion(std::array<uint8_t, N> bytes, uint32_t version) {
  for (int i = 0; i < 4; ++i) bytes[8 + i] = static_cast<uint8_t>(version >> (8 * i));
  return bytes;
}

// Two loom builds of different wire versions (hosts with different releases installed):
// the acceptor answers the other build's Hello with a note of its own version and closes,
// and an initiator that gets such a note fails naming both versions. Before, the acceptor
// closed without a word, and the initiator connected again and again until the creation
// timeout, whose message spoke of ranks that did not join.
TEST_F(TwoHosts, LoomBuildsOfDifferentWireVersionsSayWhich) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const std::string address = exchangeAddresses(ctx, 1 - ctx.rank);
    const ChannelShape shape{4096, 4};
    const uint32_t other = kWireVersion + 1;
    if (ctx.rank == 0) {
      auto in = acceptOne(expecting(kComm, kSecret, shape));
      const auto deadline = Clock::now() + kPatience;
      expectError(
          [&] {
            while (!in->ready()) LOOM_CHECK(Clock::now() < deadline, << "no verdict");
          },
          ErrorCode::kPeerFailure,
          {("speaks loom wire version " + std::to_string(other) + " where this build speaks " +
            std::to_string(kWireVersion))
               .c_str()});
      in.reset();  // closed, as the network service closes a refused connection
      // Then as a build of the other version, answering loom's Hello with its note.
      std::unique_ptr<Endpoint> endpoint;
      while (!endpoint && Clock::now() < deadline) {
        endpoint = Fabric::instance().acceptNext(std::chrono::milliseconds(10));
      }
      LOOM_CHECK(endpoint != nullptr, << "no second connection");
      uint8_t hello[128];
      endpoint->postReceive(hello, sizeof hello, nullptr);
      endpoint->start();
      Completion done[4];
      while (endpoint->poll(done) == 0) LOOM_CHECK(Clock::now() < deadline, << "no Hello");
      const auto note = asVersion(encodeVersionNote(), other);
      LOOM_CHECK(endpoint->inject(note.data(), note.size()));
      ctx.store->get("initiator told", kPatience);
      return;
    }
    {
      Rogue older(address);
      Hello hello = traffic(1, 0);
      hello.nonce = freshNonce();
      const auto bytes = asVersion(encodeHello(hello), other);
      older.send(bytes.data(), bytes.size());
      const std::vector<uint8_t> note = older.awaitMessage();
      LOOM_CHECK(note.size() == kVersionNoteBytes && declaredVersion(note) == kWireVersion,
                 << note.size() << " bytes");
      older.awaitClosed();
    }
    SendChannel out(Fabric::instance(), address, traffic(1, 0), kSecret, shape);
    const auto deadline = Clock::now() + kPatience;
    expectError(
        [&] {
          while (!out.ready()) LOOM_CHECK(Clock::now() < deadline, << "no verdict");
        },
        ErrorCode::kPeerFailure,
        {("speaks wire version " + std::to_string(other)).c_str(),
         "install the same loom release on every host", "10.77.0.1"});
    ctx.store->set("initiator told", Bytes{1});
  });
}

TEST_F(TwoHosts, APeerThatDiesMidMessageFailsTheReaderNamingIt) {
  const NetnsHosts& hosts = *hosts_;
  LOOM_RUN_RANKS(2, [&](RankContext& ctx) {
    hosts.enter(ctx.rank);
    const int peer = 1 - ctx.rank;
    const std::string address = exchangeAddresses(ctx, peer);
    auto link = linkWith(ctx.rank, peer, address, ChannelShape{4096, 4});
    if (ctx.rank == 1) {
      // Half a message, then the process is gone (as if killed: no goodbye).
      std::vector<uint8_t> payload(1 << 20, 1);
      uint64_t done = 0;
      const auto deadline = Clock::now() + kPatience;
      while (done < payload.size() / 2) {
        LOOM_CHECK(Clock::now() < deadline, << "stuck at " << done);
        link->write({0, payload.size()}, payload.data(), done);
      }
      ::_exit(0);
    }
    std::vector<uint8_t> buffer(1 << 20);
    size_t filled = 0;
    const auto deadline = Clock::now() + kPatience;
    expectError(
        [&] {
          std::optional<Envelope> envelope;
          while (!envelope) envelope = link->nextEnvelope();
          for (;;) {
            LOOM_CHECK(Clock::now() < deadline, << "the reader was not told");
            filled += link->read(buffer.data() + filled, buffer.size() - filled);
            LOOM_CHECK(filled < buffer.size(), << "a whole message from a dead peer");
          }
        },
        ErrorCode::kPeerFailure, {"10.77.0.2", "closed"});
    LOOM_CHECK(filled >= buffer.size() / 4, << "only " << filled << " bytes arrived first");
  });
}

}  // namespace
}  // namespace loom::net
