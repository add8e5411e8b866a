// Soak: 8 ranks, checked collectives on 4 groups at once + ring p2p, time-bounded; no leaks.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <latch>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../common/forked_ranks.h"
#include "../common/process_stats.h"
#include "../common/reference.h"
#include "../common/stress_driver.h"

#if defined(__SANITIZE_ADDRESS__)
#define LOOM_SOAK_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOOM_SOAK_ASAN 1
#endif
#endif

namespace loom {
namespace {

using Clock = std::chrono::steady_clock;
using testing::ProcessStats;

constexpr int kRanks = 8;
constexpr int kBatchOps = 50;  // random collectives between two stop agreements
// The ranks' environment: 128 KiB halves, so all_to_all, reduce_scatter and scatter (one
// region of 16 KiB per destination on the world) pipeline the driver's operations over
// several chunks, while the copy-out of a chunk-sized all_gather on the world (1 MiB) or the
// evens (512 KiB) is split over the helper pool; 64 KiB rings, so larger messages stream;
// three threads per rank, so the pool has helpers even on a 2-core CI host (where the
// default would be none).
constexpr size_t kChunkBytes = 128 << 10;
constexpr size_t kRingBytes = 64 << 10;
constexpr int kLoomThreads = 3;
constexpr auto kProgressEvery = std::chrono::seconds(15);

// A thread that has just been joined can still be listed in /proc/self/task for a moment
// (the kernel wakes the joiner before it releases the thread), more so on a loaded host:
// samples until the count is `threads`, for at most 5 s, and returns the last sample, so a
// thread that really stays is still caught.
ProcessStats sampleOnceThreadsAre(int threads) {
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  ProcessStats sample = testing::sampleProcess();
  while (sample.threads != threads && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    sample = testing::sampleProcess();
  }
  return sample;
}

// RSS may grow this much between the warm-up and the end. What legitimately grows: glibc's
// per-thread arenas keep freed blocks (about ten threads per rank, each peaking at a few
// hundred KiB of driver buffers and messages of up to 256 KiB; the dynamic mmap threshold
// keeps such blocks in the heap once one has been freed), and shared pages touched late: the
// stop votes (24 bytes a round to and from every peer) walk through the 12 rings to and from
// non-neighbours, 64 KiB each, in about 2700 rounds. Measured: 2.5 to 5.5 MiB in 120 s, most
// of it in the first 30 s (and under ASan the live heap does not grow at all). A rank runs
// about 1000 operations a second on a 2-core host, so a leak of even 1 KiB per operation
// passes 32 MiB within a minute, and one of the buffers that dominate the traffic within
// seconds.
constexpr long kRssGrowthKiB = 32 << 10;

#ifdef LOOM_SOAK_ASAN
// Under ASan, RSS mostly measures its quarantine (freed memory held back, 256 MiB by
// default, plus redzones and shadow), so the bound applies to the allocator's live bytes
// instead; RSS is only reported.
extern "C" size_t __sanitizer_get_current_allocated_bytes();
long liveHeapKiB() {
  return static_cast<long>(__sanitizer_get_current_allocated_bytes() / 1024);
}
#endif

int soakSeconds() {
  const char* env = std::getenv("LOOM_SOAK_SECONDS");
  return env != nullptr ? std::max(1, std::atoi(env)) : 120;
}

void logLine(int fd, const std::string& line) {
  const std::string text = line + "\n";
  [[maybe_unused]] ssize_t k = ::write(fd, text.data(), text.size());
}

// ---- Point-to-point ring traffic on the world ----

constexpr int kTagRing = 1;       // to the right neighbour, several per round: order checked
constexpr int kTagBack = 2;       // to the left neighbour, received with kAnySource
constexpr int kTagVote = 3;       // the stop agreement
constexpr int kRingMessages = 4;  // per round on kTagRing

// Size of message `index` of `round` from `sender`: empty, tiny, medium, exactly one ring,
// or up to four rings (streamed while the receiver drains). Every rank can compute any
// sender's sizes, so receives are posted with the exact size.
size_t messageBytes(uint32_t seed, int round, int sender, int index) {
  std::seed_seq seq{seed, static_cast<uint32_t>(round), static_cast<uint32_t>(sender),
                    static_cast<uint32_t>(index)};
  std::mt19937 rng(seq);
  switch (rng() % 6) {
    case 0: return 0;
    case 1: return 1 + rng() % 64;
    case 2: return 1 + rng() % (16 << 10);
    case 3: return kRingBytes;
    default: return kRingBytes + 1 + rng() % (3 * kRingBytes);
  }
}

std::vector<uint8_t> payload(int sender, int round, int index, size_t bytes) {
  std::vector<uint8_t> data(bytes);
  const uint64_t base = (static_cast<uint64_t>(sender) << 56) ^
                        (static_cast<uint64_t>(index) << 48) ^ (static_cast<uint64_t>(round) << 24);
  for (size_t j = 0; j < bytes; ++j) {
    data[j] = static_cast<uint8_t>(((base ^ j) * 0x9E3779B97F4A7C15ull) >> 56);
  }
  return data;
}

struct RingResult {
  std::string failure;
  long messages = 0;  // payload messages received and checked (votes not counted)
  uint64_t bytes = 0;
  int rounds = 0;
};

// Rounds of ring traffic until some rank finds `deadline` passed. After each round every
// rank sends its "time is up" flag (and its round number, checked) to every other rank, and
// all take the maximum, so all stop after the same round (the world's collectives belong to
// another thread, so the vote cannot be an all_reduce).
RingResult driveRing(Communicator& world, Clock::time_point deadline, uint32_t seed,
                     const std::function<void(int, long)>& afterRound) {
  RingResult result;
  const int me = world.rank();
  const int size = world.size();
  const int right = (me + 1) % size;
  const int left = (me + size - 1) % size;
  try {
    for (;;) {
      const int round = result.rounds;
      std::vector<std::vector<uint8_t>> in(kRingMessages + 1);
      std::vector<std::vector<uint8_t>> out(kRingMessages + 1);
      std::vector<Request> recvs;
      std::vector<Request> sends;
      // Receives from the left (in order, one tag), and one from the right by any-source.
      for (int i = 0; i < kRingMessages; ++i) {
        in[i].resize(messageBytes(seed, round, left, i));
        recvs.push_back(world.recv(in[i].data(), in[i].size(), DataType::kUInt8, left, kTagRing));
      }
      in[kRingMessages].resize(messageBytes(seed, round, right, kRingMessages));
      recvs.push_back(world.recv(in[kRingMessages].data(), in[kRingMessages].size(),
                                 DataType::kUInt8, kAnySource, kTagBack));
      for (int i = 0; i <= kRingMessages; ++i) {
        const int to = i < kRingMessages ? right : left;
        out[i] = payload(me, round, i, messageBytes(seed, round, me, i));
        sends.push_back(world.send(out[i].data(), out[i].size(), DataType::kUInt8, to,
                                   i < kRingMessages ? kTagRing : kTagBack));
      }
      for (Request& s : sends) s.wait();
      for (int i = 0; i <= kRingMessages; ++i) {
        recvs[i].wait();
        const int from = i < kRingMessages ? left : right;
        if (recvs[i].sourceRank() != from) {
          result.failure = "round " + std::to_string(round) + " message " + std::to_string(i) +
                           ": came from rank " + std::to_string(recvs[i].sourceRank()) +
                           ", expected " + std::to_string(from);
          return result;
        }
        const std::vector<uint8_t> want = payload(from, round, i, in[i].size());
        if (in[i] != want) {
          const size_t at = static_cast<size_t>(
              std::mismatch(in[i].begin(), in[i].end(), want.begin()).first - in[i].begin());
          result.failure = "round " + std::to_string(round) + " message " + std::to_string(i) +
                           " from rank " + std::to_string(from) + " (" +
                           std::to_string(in[i].size()) + " bytes): byte " + std::to_string(at) +
                           " is " + std::to_string(in[i][at]) + ", expected " +
                           std::to_string(want[at]);
          return result;
        }
        ++result.messages;
        result.bytes += in[i].size();
      }
      ++result.rounds;

      const std::array<int32_t, 2> mine = {Clock::now() >= deadline ? 1 : 0, result.rounds};
      std::vector<std::array<int32_t, 2>> votes(static_cast<size_t>(size));
      std::vector<Request> voting;
      for (int q = 0; q < size; ++q) {
        if (q == me) continue;
        voting.push_back(world.recv(votes[q].data(), 2, DataType::kInt32, q, kTagVote));
        voting.push_back(world.send(mine.data(), 2, DataType::kInt32, q, kTagVote));
      }
      for (Request& v : voting) v.wait();
      int32_t stop = mine[0];
      for (int q = 0; q < size; ++q) {
        if (q == me) continue;
        if (votes[q][1] != result.rounds || (votes[q][0] != 0 && votes[q][0] != 1)) {
          result.failure = "vote after round " + std::to_string(round) + ": rank " +
                           std::to_string(q) + " sent (" + std::to_string(votes[q][0]) + ", " +
                           std::to_string(votes[q][1]) + ")";
          return result;
        }
        stop = std::max(stop, votes[q][0]);
      }
      if (afterRound) afterRound(result.rounds, result.messages);
      if (stop != 0) return result;
    }
  } catch (const std::exception& e) {
    result.failure = "round " + std::to_string(result.rounds) + ": " + e.what();
  }
  return result;
}

// ---- One rank ----

// A checked all_gather of one chunk per rank: on the world and the evens its copy-out is
// split over the helper pool, which the driver's smaller operations never use. Returns the
// first failure ("" if right).
std::string largeAllGather(Communicator& comm, uint32_t salt) {
  const size_t n = kChunkBytes / 4;
  try {
    const auto in = testing::inputBytes(DataType::kFloat32, n, comm.rank(), salt);
    std::vector<uint8_t> out(kChunkBytes * static_cast<size_t>(comm.size()));
    comm.allGather(in.data(), out.data(), n, DataType::kFloat32).wait();
    for (int q = 0; q < comm.size(); ++q) {
      const std::string d = testing::firstDifference(
          out.data() + q * kChunkBytes, testing::inputBytes(DataType::kFloat32, n, q, salt).data(),
          DataType::kFloat32, n);
      if (!d.empty())
        return "large all_gather " + std::to_string(salt) + ", block " + std::to_string(q) + ": " +
               d;
    }
  } catch (const std::exception& e) {
    return "large all_gather " + std::to_string(salt) + ": " + e.what();
  }
  return "";
}

// A communicator and what its thread did.
struct Group {
  std::string name;
  std::shared_ptr<Communicator> comm;
  uint32_t seed = 0;  // the same on every member
  testing::TimedDrive result;
  long large = 0;            // large all_gathers between batches
  std::string largeFailure;  // the first of them that failed
};

std::string mib(uint64_t bytes) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << static_cast<double>(bytes) / (1 << 20) << " MiB";
  return os.str();
}

void soakRank(testing::RankContext& ctx, int seconds, int logFd) {
  const int me = ctx.rank;
  const auto shmBefore = testing::sharedMemoryFootprint();
  const ProcessStats before = testing::sampleProcess();
  const auto start = Clock::now();

  // A hang surfaces as loom's own timeout error (naming the operation) well before the
  // harness kills the rank.
  auto options = [](const char* name) {
    CommOptions o;
    o.name = name;
    o.timeout = std::chrono::minutes(3);
    return o;
  };
  std::vector<Group> groups;
  auto add = [&](const char* name, std::shared_ptr<Communicator> comm, uint32_t seed) {
    Group g;
    g.name = name;
    g.comm = std::move(comm);
    g.seed = seed;
    groups.push_back(std::move(g));
  };
  add("world", ctx.connect(options("world")), 1000);
  std::shared_ptr<Communicator> world = groups[0].comm;
  add("pairs", world->split(me / 2, me, options("pairs")), 2000 + static_cast<uint32_t>(me / 2));
  add("thirds", world->split(me % 3, me, options("thirds")), 3000 + static_cast<uint32_t>(me % 3));
  if (me % 2 == 0) {
    const int evens[] = {0, 2, 4, 6};
    add("evens", world->subset(evens, "evens", options("evens")), 4000);
  }

  // The helper pool grows on demand up to kLoomThreads - 1 threads and keeps them for the
  // life of the process: fill it now (this all_gather's copy-out splits into kLoomThreads
  // parts) and count what it started, for the accounting at the end.
  const int threadsBeforePool = testing::sampleProcess().threads;
  const std::string poolFailure = largeAllGather(*world, 7);
  LOOM_CHECK(poolFailure.empty(), << poolFailure);
  const int helpers = testing::sampleProcess().threads - threadsBeforePool;
  LOOM_CHECK(helpers >= 0 && helpers <= kLoomThreads - 1,
             << "the helper pool started " << helpers << " threads");

  const auto deadline = Clock::now() + std::chrono::seconds(seconds);
  const int activities = static_cast<int>(groups.size()) + 1;  // + the ring traffic
  std::latch warmedUp(activities);  // each activity's first batch (round) is done
  std::latch sampled(1);            // the warm-up sample is taken
  std::atomic<long> collectives{0};
  std::atomic<long> messages{0};
  std::atomic<int> finished{0};
  // A failure anywhere aborts every communicator of this rank, which fails its peers' copies
  // too: the whole job ends at once with the first failure in some rank's report.
  auto abortAll = [&] {
    for (Group& g : groups) g.comm->abort();
  };

  std::vector<std::thread> threads;
  for (Group& g : groups) {
    threads.emplace_back([&, &g = g] {
      bool arrived = false;
      long counted = 0;
      g.result = testing::driveRandomCollectivesUntil(
          *g.comm, deadline, kBatchOps, g.seed, [&](int batches, long ops) {
            collectives += ops - counted;
            counted = ops;
            // Every member runs this after the same batch: a large all_gather that splits
            // over the helper pool while other communicators' workers want it too.
            if (g.largeFailure.empty()) {
              g.largeFailure =
                  largeAllGather(*g.comm, g.seed * 7919 + static_cast<uint32_t>(batches));
              if (!g.largeFailure.empty()) abortAll();
              ++g.large;
              ++collectives;
            }
            if (batches == 1) {
              arrived = true;
              warmedUp.count_down();
              sampled.wait();
            }
          });
      if (!g.result.failure.empty()) abortAll();
      if (!arrived) warmedUp.count_down();
      ++finished;
    });
  }
  RingResult ring;
  threads.emplace_back([&] {
    bool arrived = false;
    long counted = 0;
    ring = driveRing(*world, deadline, 5000, [&](int rounds, long total) {
      messages += total - counted;
      counted = total;
      if (rounds == 1) {
        arrived = true;
        warmedUp.count_down();
        sampled.wait();
      }
    });
    if (!ring.failure.empty()) abortAll();
    if (!arrived) warmedUp.count_down();
    ++finished;
  });

  // Warm-up: every communicator has run a batch (workers, the point-to-point engine, the
  // helper pool, rings and slots all exist), and our own threads are all alive and parked.
  warmedUp.wait();
  const ProcessStats warm = testing::sampleProcess();
#ifdef LOOM_SOAK_ASAN
  const long warmHeapKiB = liveHeapKiB();
#endif
  sampled.count_down();

  auto nextProgress = start + kProgressEvery;
  while (finished.load() < activities) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (me == 0 && Clock::now() >= nextProgress) {
      nextProgress += kProgressEvery;
      const auto elapsed = std::chrono::duration_cast<std::chrono::seconds>(Clock::now() - start);
      logLine(logFd, "soak: " + std::to_string(elapsed.count()) + "/" + std::to_string(seconds) +
                         " s, " + std::to_string(collectives.load()) + " collectives + " +
                         std::to_string(messages.load()) + " messages checked (rank 0, rss " +
                         std::to_string(testing::sampleProcess().rssKiB / 1024) + " MiB)");
    }
  }
  for (std::thread& t : threads) t.join();
  std::string failure;
  for (const Group& g : groups) {
    if (failure.empty() && !g.largeFailure.empty()) failure = g.name + ": " + g.largeFailure;
    if (failure.empty() && !g.result.failure.empty()) failure = g.name + ": " + g.result.failure;
  }
  if (failure.empty() && !ring.failure.empty()) failure = "ring: " + ring.failure;
  LOOM_CHECK(failure.empty(), << failure);

  // A peer's exit closes the pidfd this rank watches it with: sample while every rank is
  // alive, and let none go on to destroy and exit before all have sampled.
  world->barrier().wait();
  const ProcessStats end = sampleOnceThreadsAre(warm.threads - activities);
#ifdef LOOM_SOAK_ASAN
  const long endHeapKiB = liveHeapKiB();
#endif
  world->barrier().wait();
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();

  std::ostringstream summary;
  summary.setf(std::ios::fixed);
  summary.precision(1);
  summary << "soak rank " << me << ": " << wall << " s;";
  for (const Group& g : groups) {
    summary << " " << g.name << " " << g.result.operations + g.large << " ops/" << g.result.batches
            << " batches;";
  }
  summary << " ring " << ring.messages << " messages (" << mib(ring.bytes) << ")/" << ring.rounds
          << " rounds; pool helpers " << helpers << "; warm-up {" << testing::describe(warm)
          << "} end {" << testing::describe(end) << "}";
#ifdef LOOM_SOAK_ASAN
  summary << "; live heap " << warmHeapKiB << " -> " << endHeapKiB << " KiB (ASan)";
#endif

  // Flat from the warm-up to the end (communicators still alive): our threads have ended,
  // nothing else may differ.
  LOOM_CHECK(end.fds == warm.fds, << summary.str());
  LOOM_CHECK(end.threads == warm.threads - activities, << summary.str());
  LOOM_CHECK(end.loomMappings == warm.loomMappings, << summary.str());
#ifdef LOOM_SOAK_ASAN
  LOOM_CHECK(endHeapKiB - warmHeapKiB < kRssGrowthKiB, << summary.str());
#else
  LOOM_CHECK(end.rssKiB - warm.rssKiB < kRssGrowthKiB, << summary.str());
#endif

  // Destroyed: every segment unmapped and every fd closed, except what lives as long as the
  // process: the process service (its listening socket and eventfd, its thread; started by
  // the first communicator) and the helper pool's threads.
  groups.clear();
  world.reset();
  const ProcessStats destroyed = sampleOnceThreadsAre(before.threads + 1 + helpers);
  summary << "; destroyed {" << testing::describe(destroyed) << "} before {"
          << testing::describe(before) << "}";
  std::cout << summary.str() << std::endl;
  LOOM_CHECK(destroyed.loomMappings == 0, << summary.str());
  LOOM_CHECK(destroyed.fds == before.fds + 2, << summary.str());
  LOOM_CHECK(destroyed.threads == before.threads + 1 + helpers, << summary.str());
  const auto shmAfter = testing::sharedMemoryFootprint();
  LOOM_CHECK(shmAfter == shmBefore,
             << "shared memory before the soak: " << testing::describe(shmBefore)
             << "; after: " << testing::describe(shmAfter));
}

TEST(Soak, EightRanksSeveralGroupsMixedTraffic) {
  const int seconds = soakSeconds();
  // Rank 0's progress goes straight to this process's stderr (rank output is otherwise
  // collected and shown only at the end).
  const int logFd = ::dup(STDERR_FILENO);
  ASSERT_GE(logFd, 0);
  testing::RunOptions options;
  options.environment = {"LOOM_CHUNK_BYTES=" + std::to_string(kChunkBytes),
                         "LOOM_P2P_RING_BYTES=" + std::to_string(kRingBytes),
                         "LOOM_THREADS=" + std::to_string(kLoomThreads)};
  // The soak, the last batch of each group, and loom's own 3-minute operation timeout.
  options.timeout = std::chrono::seconds(seconds + 240);
  const auto outcomes = testing::runRanks(
      kRanks, [&](testing::RankContext& ctx) { soakRank(ctx, seconds, logFd); }, options);
  ::close(logFd);
  const std::string report = testing::failures(outcomes);
  EXPECT_TRUE(report.empty()) << report;
  if (report.empty()) {
    for (const auto& o : outcomes) std::cout << o.output;
  }
}

}  // namespace
}  // namespace loom
