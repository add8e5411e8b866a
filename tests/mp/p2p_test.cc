// Tag-matched send/recv: sizes beyond the ring, out-of-order tags, any-source, ring
// exchanges that would deadlock with blocking sends, size mismatches, and send/recv
// interleaved with collectives.

#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "../common/forked_ranks.h"
#include "../common/reference.h"
#include "../common/thread_census.h"
#include "loom/error.h"
#include "small_rings.h"

namespace loom {
namespace {

using testing::inputBytes;
using testing::RankContext;

using testing::smallRings;
constexpr auto& expectOk = testing::expectOkOnSmallRings;

TEST(SendRecv, PingPongOfEverySize) {
  expectOk(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const int peer = 1 - ctx.rank;
    uint32_t salt = 0;
    for (size_t count : {size_t{0}, size_t{1}, size_t{1000}, size_t{4096}, size_t{300000}}) {
      ++salt;
      if (ctx.rank == 0) {
        const auto out = inputBytes(DataType::kFloat32, count, 0, salt);
        comm->send(out.data(), count, DataType::kFloat32, peer, 7).wait();
        std::vector<uint8_t> back(out.size());
        comm->recv(back.data(), count, DataType::kFloat32, peer, 8).wait();
        LOOM_CHECK(back == inputBytes(DataType::kFloat32, count, 1, salt), << count);
      } else {
        std::vector<uint8_t> in(count * 4);
        const Request r = comm->recv(in.data(), count, DataType::kFloat32, peer, 7);
        r.wait();
        LOOM_CHECK(r.sourceRank() == 0);
        LOOM_CHECK(in == inputBytes(DataType::kFloat32, count, 0, salt), << count);
        const auto out = inputBytes(DataType::kFloat32, count, 1, salt);
        comm->send(out.data(), count, DataType::kFloat32, peer, 8).wait();
      }
    }
  });
}

TEST(SendRecv, TagsMatchOutOfOrderAndSameTagsStayInOrder) {
  expectOk(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    if (ctx.rank == 0) {
      // Tag 1 (large, buffered by the receiver), then tag 2, then three messages of tag 3.
      const auto a = inputBytes(DataType::kInt32, 50000, 0, 1);
      const auto b = inputBytes(DataType::kInt32, 10, 0, 2);
      const std::vector<int32_t> values{0, 1, 2};  // alive until the sends complete
      std::vector<Request> sends;
      sends.push_back(comm->send(a.data(), 50000, DataType::kInt32, 1, 1));
      sends.push_back(comm->send(b.data(), 10, DataType::kInt32, 1, 2));
      for (const int32_t& v : values) sends.push_back(comm->send(&v, 1, DataType::kInt32, 1, 3));
      for (auto& s : sends) s.wait();
    } else {
      std::vector<uint8_t> b(40), a(200000);
      comm->recv(b.data(), 10, DataType::kInt32, 0, 2).wait();  // receive tag 2 first
      comm->recv(a.data(), 50000, DataType::kInt32, 0, 1).wait();
      LOOM_CHECK(a == inputBytes(DataType::kInt32, 50000, 0, 1));
      LOOM_CHECK(b == inputBytes(DataType::kInt32, 10, 0, 2));
      for (int32_t i = 0; i < 3; ++i) {
        int32_t v = -1;
        comm->recv(&v, 1, DataType::kInt32, 0, 3).wait();
        LOOM_CHECK(v == i, << "same-tag messages out of order");
      }
    }
  });
}

TEST(SendRecv, AnySourceReportsTheSender) {
  expectOk(4, [](RankContext& ctx) {
    auto comm = ctx.connect();
    if (ctx.rank != 0) {
      const auto data = inputBytes(DataType::kInt64, 100, ctx.rank, 5);
      comm->send(data.data(), 100, DataType::kInt64, 0, 5).wait();
      return;
    }
    std::vector<bool> seen(4, false);
    for (int i = 0; i < 3; ++i) {
      std::vector<uint8_t> in(800);
      const Request r = comm->recv(in.data(), 100, DataType::kInt64, kAnySource, 5);
      r.wait();
      const int from = r.sourceRank();
      LOOM_CHECK(from >= 1 && from <= 3 && !seen[from], << from);
      seen[from] = true;
      LOOM_CHECK(in == inputBytes(DataType::kInt64, 100, from, 5));
    }
  });
}

TEST(SendRecv, RingExchangeOfLargeMessagesDoesNotDeadlock) {
  expectOk(4, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const int next = (ctx.rank + 1) % ctx.size;
    const int prev = (ctx.rank + ctx.size - 1) % ctx.size;
    const size_t count = 200000;  // far larger than the 16 KiB ring
    const auto out = inputBytes(DataType::kFloat32, count, ctx.rank, 9);
    std::vector<uint8_t> in(out.size());
    const Request s = comm->send(out.data(), count, DataType::kFloat32, next, 0);
    const Request r = comm->recv(in.data(), count, DataType::kFloat32, prev, 0);
    s.wait();
    r.wait();
    LOOM_CHECK(in == inputBytes(DataType::kFloat32, count, prev, 9));
  });
}

TEST(SendRecv, SelfSendWorks) {
  expectOk(1, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const auto out = inputBytes(DataType::kUInt8, 100000, 0, 3);
    std::vector<uint8_t> in(out.size());
    const Request r = comm->recv(in.data(), in.size(), DataType::kUInt8, 0, 1);
    comm->send(out.data(), out.size(), DataType::kUInt8, 0, 1).wait();
    r.wait();
    LOOM_CHECK(in == out);
  });
}

TEST(SendRecv, SizeMismatchFailsThatReceiveOnly) {
  expectOk(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    if (ctx.rank == 0) {
      const std::vector<float> big(100, 1.0f), ok(3, 2.0f);
      comm->send(big.data(), 100, DataType::kFloat32, 1, 1).wait();
      comm->send(ok.data(), 3, DataType::kFloat32, 1, 1).wait();
    } else {
      std::vector<float> small(50);
      try {
        comm->recv(small.data(), 50, DataType::kFloat32, 0, 1).wait();
        LOOM_CHECK(false, << "a size mismatch must fail");
      } catch (const Error& e) {
        LOOM_CHECK(e.code() == ErrorCode::kInvalidArgument, << e.what());
        LOOM_CHECK(std::string(e.what()).find("400 bytes, more than this recv's buffer holds") !=
                       std::string::npos,
                   << e.what());
      }
      std::vector<float> next(3);
      comm->recv(next.data(), 3, DataType::kFloat32, 0, 1).wait();
      LOOM_CHECK(next[0] == 2.0f && next[2] == 2.0f);
    }
  });
}

// A message smaller than the receive's buffer fills its front and leaves the rest as it was,
// as Gloo and MPI do: received before its receive is posted and after, within the ring and
// streamed through it (16 KiB rings here), and from any source.
TEST(SendRecv, ASmallerMessageFillsTheFrontOfTheBuffer) {
  expectOk(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const size_t sizes[] = {1, 1000, 50000};
    if (ctx.rank == 0) {
      for (size_t count : sizes) {
        const auto out = inputBytes(DataType::kFloat32, count, 0, static_cast<uint32_t>(count));
        comm->send(out.data(), count, DataType::kFloat32, 1, 5).wait();  // received unposted
        comm->barrier().wait();
        comm->send(out.data(), count, DataType::kFloat32, 1, 6).wait();  // into a posted one
      }
    } else {
      for (size_t count : sizes) {
        const auto want = inputBytes(DataType::kFloat32, count, 0, static_cast<uint32_t>(count));
        for (int tag : {5, 6}) {
          std::vector<uint8_t> buffer((count + 7) * 4, 0xAB);
          Request r =
              tag == 6 ? comm->recv(buffer.data(), count + 7, DataType::kFloat32, kAnySource, tag)
                       : Request();
          if (tag == 5) {
            comm->barrier().wait();  // the message has arrived unexpected by now or soon
            r = comm->recv(buffer.data(), count + 7, DataType::kFloat32, 0, tag);
          }
          r.wait();
          LOOM_CHECK(r.sourceRank() == 0);
          LOOM_CHECK(std::equal(want.begin(), want.end(), buffer.begin()), << count);
          LOOM_CHECK(std::all_of(buffer.begin() + want.size(), buffer.end(),
                                 [](uint8_t b) { return b == 0xAB; }),
                     << "the tail after " << count << " elements was written");
        }
      }
    }
  });
}

TEST(SendRecv, InterleavesWithCollectives) {
  expectOk(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const size_t count = 100000;
    float x = 1.0f, y = 0.0f;
    if (ctx.rank == 0) {
      // A large send issued before the collective: blocking sends would deadlock here.
      const auto data = inputBytes(DataType::kFloat32, count, 0, 4);
      const Request s = comm->send(data.data(), count, DataType::kFloat32, 1, 0);
      comm->allReduce(&x, &y, 1, DataType::kFloat32, ReduceKind::kSum).wait();
      s.wait();
    } else {
      comm->allReduce(&x, &y, 1, DataType::kFloat32, ReduceKind::kSum).wait();
      std::vector<uint8_t> in(count * 4);
      comm->recv(in.data(), count, DataType::kFloat32, 0, 0).wait();
      LOOM_CHECK(in == inputBytes(DataType::kFloat32, count, 0, 4));
    }
    LOOM_CHECK(y == 2.0f);
  });
}

TEST(SendRecv, ReceiveTimesOutWithAClearError) {
  expectOk(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    if (ctx.rank == 1) {
      float v;
      OpOptions options;
      options.timeout = std::chrono::milliseconds(200);
      try {
        comm->recv(&v, 1, DataType::kFloat32, 0, 42, options).wait();
        LOOM_CHECK(false, << "expected a timeout");
      } catch (const Error& e) {
        LOOM_CHECK(e.code() == ErrorCode::kTimeout, << e.what());
        LOOM_CHECK(std::string(e.what()).find("tag 42") != std::string::npos, << e.what());
      }
    }
    comm->barrier().wait();
  });
}

// A sender that stops (SIGSTOP: alive, silent) once its large message has begun to land: the
// receive ends at its deadline with a timeout (it used to wait forever once its message was
// under way: only receives still waiting for a message were held to their deadline), and
// rank 1 then kills rank 0.
TEST(SendRecv, AReceiveWhoseSenderStopsMidMessageEndsAtItsDeadline) {
  const auto outcomes = testing::runRanks(
      2,
      [](RankContext& ctx) {
        auto comm = ctx.connect();
        const size_t count = size_t{64} << 20;  // 256 MiB through a 16 KiB ring
        std::vector<float> data(count, ctx.rank == 0 ? 1.0F : 0.0F);
        if (ctx.rank == 0) {
          ctx.store->set("pid", {static_cast<uint8_t>(::getpid() & 0xff),
                                 static_cast<uint8_t>((::getpid() >> 8) & 0xff),
                                 static_cast<uint8_t>((::getpid() >> 16) & 0xff),
                                 static_cast<uint8_t>((::getpid() >> 24) & 0xff)});
          ctx.store->get("posted", std::chrono::seconds(30));
          Request send = comm->send(data.data(), count, DataType::kFloat32, 1, 3);
          ctx.store->get("part arrived", std::chrono::seconds(30));
          ::raise(SIGSTOP);  // killed by rank 1 once its receive has ended
        }
        const Bytes pid = ctx.store->get("pid", std::chrono::seconds(30));
        OpOptions options;
        options.timeout = std::chrono::seconds(2);
        Request recv = comm->recv(data.data(), count, DataType::kFloat32, 0, 3, options);
        ctx.store->set("posted", {1});
        while (reinterpret_cast<volatile float*>(data.data())[0] == 0.0F) {
          std::this_thread::yield();  // the message's first bytes land in place
        }
        ctx.store->set("part arrived", {1});
        try {
          recv.wait();
          LOOM_CHECK(false, << "the receive of a message that stopped coming succeeded");
        } catch (const Error& e) {
          LOOM_CHECK(e.code() == ErrorCode::kTimeout, << e.what());
          const std::string what = e.what();
          LOOM_CHECK(
              what.find("did not finish arriving within 2000 ms") != std::string::npos ||
                  what.find("no matching message arrived within 2000 ms") != std::string::npos,
              << what);
        }
        ::kill(pid[0] | pid[1] << 8 | pid[2] << 16 | pid[3] << 24, SIGKILL);
      },
      smallRings());
  EXPECT_EQ(outcomes[0].status, SIGKILL) << outcomes[0].output;
  EXPECT_TRUE(outcomes[1].exited && outcomes[1].status == 0) << outcomes[1].output;
}

// A send part-way into a receiver that never drains it ends at its deadline, and its error
// names the send once (the failure it records already named it, and was wrapped in the
// send's description a second time on its way out).
TEST(SendRecv, ASendNeverDrainedEndsAtItsDeadlineNamingItOnce) {
  expectOk(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    if (ctx.rank == 1) {
      ctx.store->get("sent", std::chrono::seconds(30));  // alive, and receives nothing
      return;
    }
    std::vector<float> data(size_t{1} << 20, 1.0F);  // 4 MiB through a 16 KiB ring
    OpOptions options;
    options.timeout = std::chrono::milliseconds(300);
    try {
      comm->send(data.data(), data.size(), DataType::kFloat32, 1, 5, options).wait();
      LOOM_CHECK(false, << "a send nobody received succeeded");
    } catch (const Error& e) {
      const std::string what = e.what();
      LOOM_CHECK(e.code() == ErrorCode::kTimeout, << what);
      const std::string named = "to rank 1 (tag 5, 4194304 bytes): ";
      const size_t first = what.find(named);
      LOOM_CHECK(first != std::string::npos, << what);
      LOOM_CHECK(what.find(named, first + 1) == std::string::npos, << what);
      LOOM_CHECK(what.find("the receiver is not draining its channel") != std::string::npos,
                 << what);
    }
    ctx.store->set("sent", {1});
  });
}

TEST(SendRecv, ACompletionCallbackMaySendTheNextMessage) {
  // A turn of the engine, on its thread or a caller's, completes what it ended only after
  // letting go of the engine: a callback that queues the next send (as a pipeline stage's
  // does) must neither deadlock nor reorder the messages. Each message is 12 KB against a
  // 16 KiB ring, so most complete on the engine's thread as the receiver drains.
  expectOk(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    constexpr int kMessages = 100;
    constexpr size_t kCount = 3000;
    if (ctx.rank == 0) {
      std::vector<std::vector<uint8_t>> messages(kMessages);
      std::mutex mutex;
      std::condition_variable done;
      int ended = 0;  // callbacks that have returned from everything they do here
      std::function<void(int)> sendFrom = [&](int i) {
        messages[i] = inputBytes(DataType::kFloat32, kCount, 0, static_cast<uint32_t>(i));
        comm->send(messages[i].data(), kCount, DataType::kFloat32, 1, 5)
            .onComplete([&, i](const std::exception_ptr& error) {
              LOOM_CHECK(!error);
              if (i + 1 < kMessages) sendFrom(i + 1);
              std::lock_guard<std::mutex> lock(mutex);
              ++ended;
              done.notify_all();
            });
      };
      sendFrom(0);
      std::unique_lock<std::mutex> lock(mutex);
      LOOM_CHECK(done.wait_for(lock, std::chrono::seconds(30), [&] { return ended == kMessages; }),
                 << "the chain of sends stopped after " << ended);
    } else {
      std::vector<uint8_t> in(kCount * 4);
      for (int i = 0; i < kMessages; ++i) {
        comm->recv(in.data(), kCount, DataType::kFloat32, 0, 5).wait();
        LOOM_CHECK(in == inputBytes(DataType::kFloat32, kCount, 0, static_cast<uint32_t>(i)),
                   << "message " << i);
      }
    }
    comm->barrier().wait();
  });
}

TEST(SendRecv, ThreadsSendingAndReceivingAtOnceEachGetTheirOwnMessages) {
  // Callers drive their own sends and receives (a turn of the engine on their thread) while
  // the engine's thread drives the rest: four threads per rank at once, each with its own
  // tag, both directions, messages from one byte to past the ring, every one in order.
  expectOk(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const int peer = 1 - ctx.rank;
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        for (uint32_t i = 0; i < 60; ++i) {
          const size_t count = (i % 3 == 0) ? 1 : (i % 3 == 1) ? 700 : 9000;  // 9000: > 16 KiB
          const auto mine = inputBytes(DataType::kFloat32, count, ctx.rank, i * 8 + t);
          std::vector<uint8_t> theirs(mine.size());
          const Request s = comm->send(mine.data(), count, DataType::kFloat32, peer, t);
          const Request r = comm->recv(theirs.data(), count, DataType::kFloat32, peer, t);
          s.wait();
          r.wait();
          LOOM_CHECK(theirs == inputBytes(DataType::kFloat32, count, peer, i * 8 + t),
                     << "thread " << t << ", message " << i);
        }
      });
    }
    for (auto& thread : threads) thread.join();
    comm->barrier().wait();
  });
}

// How often this process's thread named `name` has been scheduled in so far (its census),
// or 0 if no thread has that name or its counters cannot be read.
uint64_t timesScheduled(const std::string& name) {
  for (const auto& [tid, thread] : testing::snapshotThreads())
    if (thread.name == name) return thread.slices;
  return 0;
}

TEST(SendRecv, AnIdleEngineSleepsUntilTheNextMessage) {
  // Once nothing is pending, the send/recv engine sleeps until rung: a timer would wake it
  // for nothing, and on a host with a rank per core each wake-up takes a core a rank needs.
  expectOk(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const int peer = 1 - ctx.rank;
    for (uint32_t round = 1; round <= 2; ++round) {
      float v = static_cast<float>(round);
      if (ctx.rank == 0) {
        comm->send(&v, 1, DataType::kFloat32, peer, 3).wait();
      } else {
        float in = 0;
        comm->recv(&in, 1, DataType::kFloat32, peer, 3).wait();
        LOOM_CHECK(in == v, << in);
      }
      comm->barrier().wait();
      if (round == 2) break;
      // Idle: give the engine time to go to sleep, then count its wake-ups over 300 ms (a
      // 50 ms polling slice would wake it 6 times; a late ring from the peer, 1 or 2).
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const uint64_t before = timesScheduled("loom-p2p");
      LOOM_CHECK(before > 0, << "no readable thread named loom-p2p");
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      const uint64_t woke = timesScheduled("loom-p2p") - before;
      LOOM_CHECK(woke <= 2, << "the idle engine woke " << woke << " times in 300 ms");
      comm->barrier().wait();
    }
  });
}

}  // namespace
}  // namespace loom
