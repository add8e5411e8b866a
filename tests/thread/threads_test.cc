// Ranks as threads of one process. They share the segment mapping, so ThreadSanitizer (the
// CI builds this suite with -fsanitize=thread) sees every access of the synchronisation
// protocol: phase counters, slots, descriptors, rings, helper threads, the worker queue.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../common/reference.h"
#include "../common/stress_driver.h"
#include "loom/communicator.h"
#include "loom/error.h"
#include "loom/flight_recorder.h"
#include "util/helper_pool.h"

namespace loom {
namespace {

using testing::inputBytes;
using testing::referenceReduce;

// Runs body(rank) on `size` threads and returns the first failure message, if any.
std::string runThreads(int size, const std::function<void(int, std::shared_ptr<Store>)>& body) {
  auto store = std::make_shared<HashStore>();
  std::vector<std::string> failures(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r, store);
      } catch (const std::exception& e) {
        failures[r] = "rank " + std::to_string(r) + ": " + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& f : failures) {
    if (!f.empty()) return f;
  }
  return "";
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

TEST(Threads, CollectivesAcrossThreadRanks) {
  ::setenv("LOOM_CHUNK_BYTES", "16K", 1);
  ::setenv("LOOM_THREADS", "2", 1);
  const std::string failure = runThreads(3, [](int rank, std::shared_ptr<Store> store) {
    auto comm = Communicator::create(rank, 3, store);
    uint32_t salt = 0;
    for (size_t count : {size_t{1}, size_t{1000}, size_t{5000}, size_t{70000}}) {
      for (DataType type : {DataType::kFloat32, DataType::kBFloat16, DataType::kInt64}) {
        ++salt;
        auto in = inputBytes(type, count, rank, salt);
        std::vector<uint8_t> out(in.size());
        comm->allReduce(in.data(), out.data(), count, type, ReduceKind::kSum).wait();
        require(out == referenceReduce(type, ReduceKind::kSum, count, 3, salt), "all_reduce");
        std::vector<uint8_t> gathered(in.size() * 3);
        comm->allGather(in.data(), gathered.data(), count, type).wait();
        for (int q = 0; q < 3; ++q) {
          const auto want = inputBytes(type, count, q, salt);
          require(std::equal(want.begin(), want.end(), gathered.begin() + q * in.size()),
                  "all_gather");
        }
        comm->broadcast(in.data(), out.data(), count, type, 1).wait();
        require(out == inputBytes(type, count, 1, salt), "broadcast");
      }
    }
    // Send/recv around a ring, larger than the ring buffer.
    const int next = (rank + 1) % 3, prev = (rank + 2) % 3;
    const auto data = inputBytes(DataType::kFloat32, 100000, rank, 99);
    std::vector<uint8_t> in(data.size());
    Request s = comm->send(data.data(), 100000, DataType::kFloat32, next, 1);
    Request r = comm->recv(in.data(), 100000, DataType::kFloat32, prev, 1);
    s.wait();
    r.wait();
    require(in == inputBytes(DataType::kFloat32, 100000, prev, 99), "send/recv");
    auto sub = comm->split(rank == 2 ? 1 : 0, 0);
    sub->barrier().wait();
  });
  ::unsetenv("LOOM_CHUNK_BYTES");
  ::unsetenv("LOOM_THREADS");
  EXPECT_EQ(failure, "");
}

// Callers drive their own sends and receives (a turn of the point-to-point engine on their
// thread while posting and while waiting) as the engine's thread drives the rest; under the
// race detector, three threads per rank exchange messages from one byte to past the ring,
// each thread with its own tag, and one rank's completion callbacks queue more sends.
TEST(Threads, SendRecvDrivenByCallersAndTheEngineAtOnce) {
  ::setenv("LOOM_P2P_RING_BYTES", "16K", 1);
  const std::string failure = runThreads(2, [](int rank, std::shared_ptr<Store> store) {
    auto comm = Communicator::create(rank, 2, store);
    const int peer = 1 - rank;
    std::vector<std::thread> callers;
    std::vector<std::string> errors(3);
    for (int t = 0; t < 3; ++t) {
      callers.emplace_back([&, t] {
        try {
          for (uint32_t i = 0; i < 20; ++i) {
            const size_t count = i % 2 == 0 ? 1 : 6000;  // 24 KB: more than the ring holds
            const auto mine = inputBytes(DataType::kFloat32, count, rank, i * 4 + t);
            std::vector<uint8_t> theirs(mine.size());
            Request s = comm->send(mine.data(), count, DataType::kFloat32, peer, t);
            Request r = comm->recv(theirs.data(), count, DataType::kFloat32, peer, t);
            s.wait();
            r.wait();
            require(theirs == inputBytes(DataType::kFloat32, count, peer, i * 4 + t),
                    "thread " + std::to_string(t) + ", message " + std::to_string(i));
          }
        } catch (const std::exception& e) {
          errors[t] = e.what();
        }
      });
    }
    for (auto& caller : callers) caller.join();
    for (const auto& e : errors) require(e.empty(), e);
    // Sends queued from completion callbacks (on whichever thread ended the last one).
    constexpr int kChained = 10;
    std::vector<std::vector<uint8_t>> messages(kChained);
    if (rank == 0) {
      std::atomic<int> sent{0};
      std::function<void(int)> sendFrom = [&](int i) {
        messages[i] = inputBytes(DataType::kFloat32, 6000, 0, 1000 + i);
        comm->send(messages[i].data(), 6000, DataType::kFloat32, 1, 9)
            .onComplete([&, i](const std::exception_ptr&) {
              if (i + 1 < kChained) sendFrom(i + 1);
              sent.fetch_add(1);  // last: after it the callback touches nothing here
            });
      };
      sendFrom(0);
      // The last callback runs once its send ends, which may be just after rank 1 has the
      // bytes; the callbacks touch this scope, so it stays until all have run.
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (sent.load() < kChained && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      require(sent.load() == kChained, "the chain of sends stopped");
      comm->barrier().wait();
    } else {
      std::vector<uint8_t> in(6000 * 4);
      for (int i = 0; i < kChained; ++i) {
        comm->recv(in.data(), 6000, DataType::kFloat32, 0, 9).wait();
        require(in == inputBytes(DataType::kFloat32, 6000, 0, 1000 + i), "chained message");
      }
      comm->barrier().wait();
    }
  });
  ::unsetenv("LOOM_P2P_RING_BYTES");
  EXPECT_EQ(failure, "");
}

// The random mixed stream of the forked stress test, on a world and a split communicator
// driven at once from two threads per rank: several workers, queued ops and one-shot,
// two-shot and chunked paths interleaving under the race detector.
TEST(Threads, RandomCollectivesOnTwoCommunicatorsAtOnce) {
  ::setenv("LOOM_CHUNK_BYTES", "16K", 1);
  const std::string failure = runThreads(4, [](int rank, std::shared_ptr<Store> store) {
    auto world = Communicator::create(rank, 4, store);
    auto pair = world->split(rank % 2, rank);
    std::string worldFailure;
    std::thread t([&] { worldFailure = testing::driveRandomCollectives(*world, 150, 1); });
    const std::string pairFailure = testing::driveRandomCollectives(*pair, 150, 2 + rank % 2);
    t.join();
    require(worldFailure.empty(), "world: " + worldFailure);
    require(pairFailure.empty(), "pair: " + pairFailure);
  });
  ::unsetenv("LOOM_CHUNK_BYTES");
  EXPECT_EQ(failure, "");
}

// A completion callback that throws, on the thread that finishes the call, is reported and
// dropped: the process goes on (it used to end in std::terminate) and the callbacks after
// it run.
TEST(Threads, ACallbackThatThrowsOnLoomsThreadIsDroppedAndTheNextRuns) {
  const std::string failure = runThreads(2, [](int rank, std::shared_ptr<Store> store) {
    auto comm = Communicator::create(rank, 2, store);
    std::atomic<int> after{0};
    float x = 1;
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    Request r = comm->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum);
    if (rank == 0) {
      require(!r.test(), "finished before rank 1 issued it");
      r.onComplete([](const std::exception_ptr&) { throw std::runtime_error("a bad callback"); });
      r.onComplete([&](const std::exception_ptr& e) {
        if (!e) after.fetch_add(1);
      });
    }
    r.wait();
    require(x == 2, "sum " + std::to_string(x));
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (rank == 0 && after.load() == 0 && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    require(rank != 0 || after.load() == 1, "the callback after the throwing one did not run");
    float y = 1;
    comm->allReduce(&y, &y, 1, DataType::kFloat32, ReduceKind::kSum).wait();
    require(y == 2, "a later call");
  });
  EXPECT_EQ(failure, "");
}

// A blocking call runs on its caller's thread only when the worker is idle, and an
// operation's completion takes no lock unless someone sleeps on it or added a callback
// (worker.h, request.cc). Under the race detector: queued calls with callbacks, blocking
// calls right behind them, and waits long enough to sleep (rank 1 comes late now and then);
// every result and every callback is checked, and a blocking call must find the call queued
// ahead of it finished.
TEST(Threads, BlockingCallsBesideQueuedOnesKeepIssueOrder) {
  const std::string failure = runThreads(2, [](int rank, std::shared_ptr<Store> store) {
    auto comm = Communicator::create(rank, 2, store);
    OpOptions blocking;
    blocking.blocking = true;
    std::atomic<int> calledBack{0};
    constexpr int kRounds = 60;
    for (int i = 0; i < kRounds; ++i) {
      if (rank == 1 && i % 10 == 3) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      float queued[3] = {float(i), float(rank), 1};
      Request q = comm->allReduce(queued, queued, 3, DataType::kFloat32, ReduceKind::kSum);
      q.onComplete([&](const std::exception_ptr& e) {
        if (!e) calledBack.fetch_add(1);
      });
      float now = float(i + rank);
      comm->allReduce(&now, &now, 1, DataType::kFloat32, ReduceKind::kSum, blocking).wait();
      require(now == float(2 * i + 1), "blocking call " + std::to_string(i));
      // Operations on one communicator finish in issue order.
      require(q.test(), "blocking call " + std::to_string(i) +
                            " finished before the call queued ahead of it");
      q.wait();
      require(queued[0] == float(2 * i) && queued[1] == 1 && queued[2] == 2,
              "queued call " + std::to_string(i));
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (calledBack.load() < kRounds && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    require(calledBack.load() == kRounds, "callbacks: " + std::to_string(calledBack.load()));
  });
  EXPECT_EQ(failure, "");
}

// A completion callback on loom's thread that waits for what only a later call of its
// communicator brings holds the queue: the hold watch gives that call up at the timeout, on a
// thread of its own, with the reason, and the callback's wait ends. Under the race detector:
// the watch, the callback, and the caller's wait all touch the queue and the call's state.
TEST(Threads, ACallbackThatHoldsTheQueueEndsTheCallsBehindItAtTheTimeout) {
  const std::string failure = runThreads(2, [](int rank, std::shared_ptr<Store> store) {
    CommOptions options;
    options.timeout = std::chrono::milliseconds(400);
    auto comm = Communicator::create(rank, 2, store, options);
    float x = 1;
    float y = 1;
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    Request first = comm->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum);
    // Shared with the callback below: a waiter may return (and this body end) as the call's
    // failure is marked, before its callbacks have run.
    auto laterEnded = std::make_shared<std::promise<std::exception_ptr>>();
    std::future<std::exception_ptr> later = laterEnded->get_future();
    // Rank 0's callback holds its queue; rank 1 learns of it from the failure.
    std::atomic<bool> callbackReturned{rank != 0};
    if (rank == 0) {
      require(!first.test(), "finished before rank 1 issued it");
      first.onComplete([&](const std::exception_ptr&) {
        later.wait_for(std::chrono::seconds(30));  // what only the next call brings
        callbackReturned = true;
      });
    }
    Request second = comm->allReduce(&y, &y, 1, DataType::kFloat32, ReduceKind::kSum);
    second.onComplete([laterEnded](const std::exception_ptr& e) { laterEnded->set_value(e); });
    std::string message;
    try {
      second.wait();
    } catch (const Error& e) {
      message = e.what();
    }
    // Rank 1's own timeout may come first: it then says where rank 0 is.
    require(message.find("completion callback") != std::string::npos &&
                (rank == 1 || message.find("never started") != std::string::npos),
            "the call behind the callback: '" + message + "'");
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!callbackReturned && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    require(callbackReturned, "the callback still waits");
  });
  EXPECT_EQ(failure, "");
}

TEST(Threads, AbortFromAnotherThreadReleasesWaiters) {
  const std::string failure = runThreads(2, [](int rank, std::shared_ptr<Store> store) {
    auto comm = Communicator::create(rank, 2, store);
    comm->barrier().wait();
    if (rank == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      comm->abort();
      return;
    }
    try {
      float x = 1;
      // Rank 1 never joins; its abort must release this wait.
      comm->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum).wait();
      require(false, "expected an abort");
    } catch (const Error& e) {
      require(e.code() == ErrorCode::kAborted, e.what());
    }
  });
  EXPECT_EQ(failure, "");
}

// ---- The helper pool on its own: every piece once, its writes visible to the caller ----

TEST(Threads, HelperPoolRunsEveryPieceOnceAndTheCallerSeesTheirWrites) {
  HelperPool& pool = HelperPool::instance();
  for (int threads : {1, 2, 3, 8}) {
    for (int pieces : {0, 1, 2, 5, 32}) {
      for (int region = 0; region < 100; ++region) {
        // Plain ints: ThreadSanitizer checks that the caller sees the helpers' writes.
        std::vector<int> ran(static_cast<size_t>(pieces), 0);
        pool.run(threads, pieces, [&](int i) { ran[static_cast<size_t>(i)] += region + 1; });
        for (int i = 0; i < pieces; ++i) {
          ASSERT_EQ(ran[static_cast<size_t>(i)], region + 1)
              << threads << " threads, " << pieces << " pieces, region " << region;
        }
      }
    }
  }
}

TEST(Threads, HelperPoolLetsAThreadDoneWithItsShareTakeAnothersPieces) {
  // Two threads, four pieces: the helper's share is pieces 2 and 3, in that order. Piece 2
  // waits until piece 3 has run, so the region ends only if a thread other than the one in
  // piece 2 takes piece 3 (with shares fixed per thread it would never end). The wait is
  // bounded so that a pool without stealing fails instead of hanging.
  HelperPool& pool = HelperPool::instance();
  for (int region = 0; region < 50; ++region) {
    std::atomic<bool> thirdRan{false};
    std::atomic<bool> stuck{false};
    std::vector<int> ran(4, 0);
    pool.run(2, 4, [&](int i) {
      if (i == 2) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!thirdRan.load()) {
          if (std::chrono::steady_clock::now() > deadline) {
            stuck = true;
            break;
          }
          std::this_thread::yield();
        }
      }
      ran[static_cast<size_t>(i)] = 1;
      if (i == 3) thirdRan = true;
    });
    ASSERT_FALSE(stuck.load()) << "region " << region << ": piece 3 waited for piece 2's thread";
    ASSERT_EQ(ran, std::vector<int>(4, 1)) << "region " << region;
  }
}

TEST(Threads, HelperPoolHandsAThrownExceptionToTheCallerAfterEveryPieceItBegan) {
  // A piece that throws, on the caller or on a helper: the caller gets the exception, but
  // only once no piece is running (a piece still running would outlive the caller's frame),
  // and the pool then serves the next region whole (every piece counted once).
  HelperPool& pool = HelperPool::instance();
  for (int threads : {2, 3, 8}) {
    for (int thrower : {0, 7}) {  // piece 0 begins the caller's share, piece 7 ends a helper's
      std::atomic<int> running{0};
      std::atomic<bool> overlapped{false};
      std::vector<int> ran(8, 0);
      try {
        pool.run(threads, 8, [&](int i) {
          running.fetch_add(1);
          // A slow piece beside the throwing one: the caller must wait for it.
          if (i != thrower) std::this_thread::sleep_for(std::chrono::milliseconds(2));
          ran[static_cast<size_t>(i)] = 1;
          running.fetch_sub(1);
          if (i == thrower) throw std::runtime_error("piece " + std::to_string(i));
        });
        ADD_FAILURE() << threads << " threads: the exception of piece " << thrower << " was lost";
      } catch (const std::runtime_error& e) {
        EXPECT_EQ(std::string(e.what()), "piece " + std::to_string(thrower));
        overlapped = running.load() != 0;
      }
      EXPECT_FALSE(overlapped.load()) << threads << " threads: a piece still ran at the throw";
      EXPECT_EQ(ran[static_cast<size_t>(thrower)], 1);
      std::vector<int> next(16, 0);
      pool.run(threads, 16, [&](int i) { next[static_cast<size_t>(i)] += 1; });
      EXPECT_EQ(next, std::vector<int>(16, 1)) << threads << " threads: the region after";
    }
  }
}

TEST(Threads, HelperPoolWakesHelpersThatFellAsleep) {
  // Idle helpers sleep after about 100 us; a region after a longer pause must still run every
  // piece (the helpers woken, or the pieces run anyway) and return.
  HelperPool& pool = HelperPool::instance();
  for (int round = 0; round < 5; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
    std::vector<int> ran(8, 0);
    pool.run(4, 8, [&](int i) { ran[static_cast<size_t>(i)] = 1; });
    EXPECT_EQ(ran, std::vector<int>(8, 1)) << "round " << round;
  }
}

TEST(Threads, HelperPoolServesCallersOnSeveralThreadsAtOnce) {
  // One region at a time: a caller that finds the pool busy runs its pieces itself. Either
  // way every caller's pieces run once and only its own.
  HelperPool& pool = HelperPool::instance();
  constexpr int kCallers = 4;
  constexpr int kPieces = 6;
  std::vector<std::vector<int>> sums(kCallers, std::vector<int>(kPieces, 0));
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int region = 0; region < 300; ++region) {
        pool.run(3, kPieces,
                 [&](int i) { sums[static_cast<size_t>(c)][static_cast<size_t>(i)] += c + 1; });
      }
    });
  }
  for (auto& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) {
    EXPECT_EQ(sums[static_cast<size_t>(c)], std::vector<int>(kPieces, 300 * (c + 1)))
        << "caller " << c;
  }
}

// A thread waiting on a receive ends many receives at their deadline in its turn and marks
// them ended after letting the engine go (a failed one tells the communicator), while another
// thread drops the communicator's last reference the moment the awaited one ends: the
// communicator must outlast the marking. It was freed under the marking thread, which then
// called into it (a review helper's reproduction crashed 4 runs in 12; ASan and TSan, which
// build this suite in CI, see it at once). The engine's own thread is held in a callback
// meanwhile, so that the waiter's turns end the receives.
TEST(Threads, ACommunicatorDroppedWhileAWaiterMarksItsReceivesEndedOutlastsTheMarking) {
  for (int round = 0; round < 3; ++round) {
    auto store = std::make_shared<HashStore>();
    std::shared_ptr<Communicator> zero;
    std::shared_ptr<Communicator> one;
    std::thread other([&] { one = Communicator::create(1, 2, store); });
    zero = Communicator::create(0, 2, store);
    other.join();
    constexpr int kReceives = 600;
    constexpr size_t kFloats =
        10240;  // 40 KiB: the engine's thread drives them, waiters expire them
    std::vector<std::vector<float>> buffers(kReceives, std::vector<float>(kFloats));
    OpOptions shortly;
    shortly.timeout = std::chrono::milliseconds(300);
    std::vector<Request> receives;
    for (int i = 0; i < kReceives; ++i) {
      receives.push_back(zero->recv(buffers[i].data(), kFloats, DataType::kFloat32, 1, i, shortly));
    }
    const Request awaited = receives.front();
    std::vector<float> held(kFloats);
    std::vector<float> sent(kFloats, 1.0f);
    Request holding = zero->recv(held.data(), kFloats, DataType::kFloat32, 1, 1 << 20);
    holding.onComplete([awaited](std::exception_ptr) {
      while (!awaited.test()) std::this_thread::sleep_for(std::chrono::microseconds(20));
    });
    // Readers of the flight record slow the marking (it ends each one's entry): the window.
    std::atomic<bool> stop{false};
    std::vector<std::thread> readers;
    for (int i = 0; i < 2; ++i) {
      readers.emplace_back([&stop] {
        while (!stop.load()) (void)flightRecord();
      });
    }
    std::thread waiter([awaited, all = std::move(receives)] {
      try {
        awaited.wait();
      } catch (const Error&) {
      }
    });
    std::thread dropper([last = std::move(zero), awaited]() mutable {
      while (!awaited.test()) std::this_thread::sleep_for(std::chrono::microseconds(20));
      last.reset();
    });
    one->send(sent.data(), kFloats, DataType::kFloat32, 0, 1 << 20).wait();
    dropper.join();
    waiter.join();
    stop = true;
    for (auto& r : readers) r.join();
    EXPECT_EQ(held, sent);
  }
}

}  // namespace
}  // namespace loom
