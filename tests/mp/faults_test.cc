// Fault injection: a rank killed with SIGKILL at a chosen point (between collectives, inside
// one after a given phase, in the middle of a point-to-point message, before joining)
// releases every survivor with an error naming the dead rank, long before the timeout. The
// survivors then rebuild without it (shrink) and get right answers, and after tearing down
// they hold exactly what they held before: no fds, mappings, threads or /dev/shm entries.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <optional>
#include <thread>

#include "../common/forked_ranks.h"
#include "../common/process_stats.h"
#include "loom/error.h"

namespace loom {
namespace {

using testing::RankContext;
using testing::sampleProcess;

// The process's footprint once its thread count has held for three samples 10 ms apart (at
// most 2 s): threads of a communicator just destroyed are joined, but the kernel can list
// one in /proc/self/task for a moment after, more so on a loaded host, and a baseline that
// counts it would read as a thread gone missing later.
testing::ProcessStats settledSample() {
  auto sample = sampleProcess();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (int same = 0; same < 3 && std::chrono::steady_clock::now() < deadline;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const auto next = sampleProcess();
    same = next.threads == sample.threads ? same + 1 : 0;
    sample = next;
  }
  return sample;
}

constexpr int kVictim = 2;
constexpr int kRanks = 4;

// Ops are long-lived enough that only the dead-peer detection can end them in time: a
// survivor that reports kTimeout instead of kPeerFailure fails the test.
CommOptions patientOptions() {
  CommOptions options;
  options.timeout = std::chrono::seconds(120);
  return options;
}

// The collective sequence every rank runs; the victim dies inside one of them.
struct Step {
  const char* name;
  std::function<Request(Communicator&, std::vector<float>&)> issue;
};

std::vector<Step> steps() {
  return {
      {"barrier", [](Communicator& c, std::vector<float>&) { return c.barrier(); }},
      {"small all_reduce",
       [](Communicator& c, std::vector<float>& b) {
         return c.allReduce(b.data(), b.data(), 64, DataType::kFloat32, ReduceKind::kSum);
       }},
      {"large all_reduce",
       [](Communicator& c, std::vector<float>& b) {
         return c.allReduce(b.data(), b.data(), b.size(), DataType::kFloat32, ReduceKind::kSum);
       }},
      {"broadcast",
       [](Communicator& c, std::vector<float>& b) {
         return c.broadcast(b.data(), b.data(), b.size(), DataType::kFloat32, 0);
       }},
      {"all_gather",
       [](Communicator& c, std::vector<float>& b) {
         return c.allGather(b.data() + c.rank() * 1024, b.data(), 1024, DataType::kFloat32);
       }},
      // 2 MiB in all, from LOOM_PEER_READ_BYTES (1 MiB here): peers copy their blocks out of
      // each other's processes, so a victim that dies after the opening leaves readers
      // facing a process that is gone.
      {"all_to_all",
       [](Communicator& c, std::vector<float>& b) {
         return c.allToAll(b.data(), b.data() + b.size() / 2, b.size() / 2 / c.size(),
                           DataType::kFloat32);
       }},
      {"all_to_all again",
       [](Communicator& c, std::vector<float>& b) {
         return c.allToAll(b.data(), b.data() + b.size() / 2, b.size() / 2 / c.size(),
                           DataType::kFloat32);
       }},
      {"barrier", [](Communicator& c, std::vector<float>&) { return c.barrier(); }},
  };
}

// Checks that `comm`, a rebuilt communicator of the survivors, computes right answers.
void expectWorks(Communicator& comm) {
  std::vector<double> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = comm.rank() * 1000.0 + static_cast<double>(i);
  comm.allReduce(v.data(), v.data(), v.size(), DataType::kFloat64, ReduceKind::kSum).wait();
  const double n = comm.size();
  for (size_t i = 0; i < v.size(); ++i) {
    const double want = 1000.0 * n * (n - 1) / 2 + n * static_cast<double>(i);
    LOOM_CHECK(v[i] == want, << "element " << i << " is " << v[i] << ", want " << want);
  }
}

struct KillPoint {
  const char* label;
  const char* killAt;  // LOOM_FAULT_KILL_AT, or nullptr: die between collectives 2 and 3
};

void PrintTo(const KillPoint& p, std::ostream* os) {
  *os << p.label;
}

class KilledRank : public ::testing::TestWithParam<KillPoint> {};

TEST_P(KilledRank, SurvivorsFailNamingItThenRebuildAndLeakNothing) {
  const KillPoint point = GetParam();
  testing::RunOptions run;
  // Small chunks: the 4 MiB all_reduce runs many phases, so a kill lands mid-pipeline.
  run.environment = {"LOOM_CHUNK_BYTES=64K", "LOOM_PEER_READ_BYTES=1M"};
  const auto outcomes = testing::runRanks(
      kRanks,
      [point](RankContext& ctx) {
        // Warm up the per-process parts (process service, helper pool) so the baseline
        // below counts only what a communicator holds.
        ctx.connect()->barrier().wait();
        const auto baseline = settledSample();
        const auto shmBefore = testing::sharedMemoryFootprint();
        if (ctx.rank == kVictim && point.killAt != nullptr) {
          ::setenv("LOOM_FAULT_KILL_AT", point.killAt, 1);
        }
        auto comm = ctx.connect(patientOptions());
        std::vector<float> buf(1 << 20, 1.0f);
        int step = 0;
        std::optional<Error> failure;
        for (const Step& s : steps()) {
          ++step;
          if (ctx.rank == kVictim && point.killAt == nullptr && step == 3) ::raise(SIGKILL);
          try {
            s.issue(*comm, buf).wait();
          } catch (const Error& e) {
            failure = e;
            break;
          }
        }
        LOOM_CHECK(ctx.rank != kVictim, << "the victim survived its kill point");
        LOOM_CHECK(failure.has_value(), << "no step failed although rank 2 died");
        LOOM_CHECK(failure->code() == ErrorCode::kPeerFailure, << "want a peer failure, got "
                                                               << errorCodeName(failure->code())
                                                               << ": " << failure->what());
        const std::string message = failure->what();
        LOOM_CHECK(message.find("rank 2") != std::string::npos, << message);
        LOOM_CHECK(message.find("exited") != std::string::npos, << message);
        // Later calls fail at once with the same story.
        try {
          comm->barrier().wait();
          LOOM_CHECK(false, << "a barrier on the failed communicator succeeded");
        } catch (const Error& e) {
          LOOM_CHECK(e.code() == ErrorCode::kPeerFailure, << e.what());
        }
        // The survivors rebuild without the dead rank and carry on.
        const std::vector<int> dead{kVictim};
        auto rebuilt = comm->shrink(dead, patientOptions());
        LOOM_CHECK(rebuilt->size() == kRanks - 1);
        LOOM_CHECK(rebuilt->rank() == (ctx.rank < kVictim ? ctx.rank : ctx.rank - 1));
        expectWorks(*rebuilt);
        rebuilt.reset();
        comm.reset();
        const auto after = settledSample();
        LOOM_CHECK(after.fds == baseline.fds,
                   << "before: " << describe(baseline) << "; after: " << describe(after));
        LOOM_CHECK(after.loomMappings == baseline.loomMappings,
                   << "before: " << describe(baseline) << "; after: " << describe(after));
        LOOM_CHECK(after.threads == baseline.threads,
                   << "before: " << describe(baseline) << "; after: " << describe(after));
        const auto shmAfter = testing::sharedMemoryFootprint();
        LOOM_CHECK(shmAfter == shmBefore, << "shared memory before: " << describe(shmBefore)
                                          << "; after: " << describe(shmAfter));
      },
      run);
  for (const auto& o : outcomes) {
    if (o.rank == kVictim) {
      EXPECT_FALSE(o.exited) << o.output;
      EXPECT_EQ(o.status, SIGKILL) << o.output;
      continue;
    }
    EXPECT_TRUE(o.exited && o.status == 0) << "rank " << o.rank << ":\n" << o.output;
    EXPECT_NE(o.output.find("what each rank of 'world' was doing"), std::string::npos) << o.output;
    EXPECT_NE(o.output.find("DEAD"), std::string::npos) << o.output;
  }
}

// Collective numbers: 1 barrier, 2 small all_reduce, 3 large all_reduce (64 phases of
// 64 KiB halves), 4 broadcast, 5 all_gather, 6 and 7 all_to_all reading peers (the first
// probes whether they can), 8 barrier.
INSTANTIATE_TEST_SUITE_P(
    Faults, KilledRank,
    ::testing::Values(
        KillPoint{"between_collectives", nullptr}, KillPoint{"after_opening_a_barrier", "1:1"},
        KillPoint{"inside_a_one_shot_all_reduce", "2:1"},
        KillPoint{"mid_pipeline_of_a_two_shot_all_reduce", "3:17"},
        KillPoint{"inside_a_broadcast", "4:3"}, KillPoint{"inside_an_all_gather", "5:1"},
        KillPoint{"while_peers_probe_it", "6:1"}, KillPoint{"while_peers_read_it", "7:1"}),
    [](const ::testing::TestParamInfo<KillPoint>& info) { return std::string(info.param.label); });

TEST(Faults, SenderKilledMidMessageFailsTheReceiverNotCorruptsIt) {
  const auto outcomes = testing::runRanks(3, [](RankContext& ctx) {
    auto comm = ctx.connect(patientOptions());
    comm->barrier().wait();
    // 1 MiB through a 256 KiB ring: the send stalls with part of the message written.
    std::vector<uint8_t> data(1 << 20, 7);
    if (ctx.rank == 1) {
      Request send = comm->send(data.data(), data.size(), DataType::kUInt8, 0, 5);
      ctx.store->set("sending", {1});
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      LOOM_CHECK(!send.test(), << "the send finished without a receiver");
      ::raise(SIGKILL);
    }
    if (ctx.rank == 0) {
      ctx.store->get("sending", std::chrono::seconds(60));
      std::this_thread::sleep_for(std::chrono::milliseconds(400));  // until rank 1 is gone
      std::vector<uint8_t> got(data.size(), 0);
      try {
        comm->recv(got.data(), got.size(), DataType::kUInt8, 1, 5).wait();
        LOOM_CHECK(false, << "a receive from a sender that died mid-message succeeded");
      } catch (const Error& e) {
        LOOM_CHECK(e.code() == ErrorCode::kPeerFailure, << e.what());
        LOOM_CHECK(std::string(e.what()).find("rank 1") != std::string::npos, << e.what());
      }
    }
    // The collectives notice too.
    try {
      comm->barrier().wait();
      LOOM_CHECK(false, << "a barrier with a dead rank succeeded");
    } catch (const Error& e) {
      LOOM_CHECK(e.code() == ErrorCode::kPeerFailure, << e.what());
    }
  });
  EXPECT_EQ(outcomes[1].status, SIGKILL) << outcomes[1].output;
  EXPECT_TRUE(outcomes[0].exited && outcomes[0].status == 0) << outcomes[0].output;
  EXPECT_TRUE(outcomes[2].exited && outcomes[2].status == 0) << outcomes[2].output;
}

TEST(Faults, RankThatNeverJoinsFailsCreateNamingIt) {
  const auto outcomes = testing::runRanks(3, [](RankContext& ctx) {
    if (ctx.rank == 2) ::raise(SIGKILL);  // dies before create
    CommOptions options;
    options.timeout = std::chrono::seconds(2);
    try {
      ctx.connect(options);
      LOOM_CHECK(false, << "create succeeded without rank 2");
    } catch (const Error& e) {
      LOOM_CHECK(e.code() == ErrorCode::kTimeout, << e.what());
      LOOM_CHECK(std::string(e.what()).find("2") != std::string::npos, << e.what());
    }
  });
  EXPECT_TRUE(outcomes[0].exited && outcomes[0].status == 0) << outcomes[0].output;
  EXPECT_TRUE(outcomes[1].exited && outcomes[1].status == 0) << outcomes[1].output;
}

// Of 3 ranks, `late` calls create 3 s into the others' 1 s timeout, with 60 s of its own:
// every rank's creation fails with kTimeout within 20 s, each error saying what `words`
// gives for its rank (nullptr: nothing asked), and every rank's next creation meets.
void expectALateRankToldAtOnceAndTheNextCreationMet(int late, const char* (*words)(int rank)) {
  const auto outcomes = testing::runRanks(3, [&](RankContext& ctx) {
    CommOptions options;
    options.timeout = std::chrono::seconds(ctx.rank == late ? 60 : 1);
    if (ctx.rank == late) std::this_thread::sleep_for(std::chrono::seconds(3));
    const auto start = std::chrono::steady_clock::now();
    try {
      ctx.connect(options);
      LOOM_CHECK(false, << "create succeeded though some rank gave up");
    } catch (const Error& e) {
      LOOM_CHECK(e.code() == ErrorCode::kTimeout, << e.what());
      const char* want = words(ctx.rank);
      LOOM_CHECK(want == nullptr || std::string(e.what()).find(want) != std::string::npos,
                 << e.what());
    }
    LOOM_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20),
               << "rank " << ctx.rank << " was told only at its own timeout");
    options.timeout = std::chrono::seconds(60);
    auto comm = ctx.connect(options);
    float x = 1, y = 0;
    comm->allReduce(&x, &y, 1, DataType::kFloat32, ReduceKind::kSum).wait();
    LOOM_CHECK(y == 3.0f, << y);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(outcomes[r].exited && outcomes[r].status == 0) << r << ": " << outcomes[r].output;
  }
}

// A rank that comes after rank 0 gave the creation up (its timeout) learns so at once from
// the store, rather than wait out its own timeout for a roster that never comes, and the
// next creation of every rank meets. The late rank waited its whole timeout, and stayed a
// store round behind rank 0 for every creation after (the rounds are counted per rank).
TEST(Faults, ARankLaterThanRank0sTimeoutIsToldAtOnceAndTheNextCreationMeets) {
  expectALateRankToldAtOnceAndTheNextCreationMet(2, [](int rank) {
    return rank == 2 ? "rank 0 gave up making communicator" : "rank(s) 2 did not join";
  });
}

// The other way round: rank 0 comes after the others gave the creation up at their timeout.
// It refuses the round at once, naming the rank that gave up, rather than make a
// communicator from their stale records and wait out its own timeout for them to connect
// (then name a live rank as exited); and the next creation of every rank meets.
TEST(Faults, ARank0LaterThanTheOthersTimeoutRefusesTheRoundAtOnceAndTheNextCreationMeets) {
  expectALateRankToldAtOnceAndTheNextCreationMet(0, [](int rank) -> const char* {
    return rank == 0 ? "rank 1 cannot join: it gave this creation up" : nullptr;
  });
}

// Rank `victim` dies while the others make a child of all of them: each names it at once,
// whether it is a member waited for by the child's leader or the leader itself (whose
// socket closes before its exit shows: the members used to say only that the leader closed
// its connection); and the parent, knowing of the death, shrinks past it.
void expectADeathWhileAChildIsMadeNamed(int victim) {
  const auto outcomes = testing::runRanks(4, [victim](RankContext& ctx) {
    CommOptions options;
    options.timeout = std::chrono::seconds(60);
    auto comm = ctx.connect(options);
    comm->barrier().wait();
    if (ctx.rank == victim) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the others are waiting
      ::raise(SIGKILL);
    }
    const int all[] = {0, 1, 2, 3};
    const auto start = std::chrono::steady_clock::now();
    try {
      comm->subset(all, "with a member that dies", options);
      LOOM_CHECK(false, << "a child with a dead member was made");
    } catch (const Error& e) {
      LOOM_CHECK(e.code() == ErrorCode::kPeerFailure, << e.what());
      LOOM_CHECK(std::string(e.what()).find("rank " + std::to_string(victim)) != std::string::npos,
                 << e.what());
    }
    LOOM_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20),
               << "named only at the timeout");
    auto survivors = comm->shrink(std::vector<int>{victim}, options);
    float x = 1;
    survivors->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum).wait();
    LOOM_CHECK(x == 3, << x);
  });
  for (int r = 0; r < 4; ++r) {
    if (r == victim) continue;
    EXPECT_TRUE(outcomes[r].exited && outcomes[r].status == 0) << outcomes[r].output;
  }
}

TEST(Faults, AMemberThatDiesWhileAChildIsMadeIsNamedAtOnce) {
  expectADeathWhileAChildIsMadeNamed(3);
}

TEST(Faults, AChildsLeaderThatDiesWhileItIsMadeIsNamedAtOnce) {
  expectADeathWhileAChildIsMadeNamed(0);
}

// A dead rank that a shrink keeps ends the shrink at once, named; it used to wait out the
// creation's timeout and then blame a rank that "never connected" or a leader that "did not
// hand over".
TEST(Faults, AShrinkThatKeepsADeadRankFailsAtOnceNamingIt) {
  const auto outcomes = testing::runRanks(4, [](RankContext& ctx) {
    CommOptions options;
    options.timeout = std::chrono::seconds(60);
    auto comm = ctx.connect(options);
    comm->barrier().wait();
    if (ctx.rank >= 2) ::raise(SIGKILL);
    try {
      comm->barrier().wait();
    } catch (const Error&) {
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      comm->shrink(std::vector<int>{2}, options);  // rank 3 is dead too
      LOOM_CHECK(false, << "a shrink that kept a dead rank succeeded");
    } catch (const Error& e) {
      LOOM_CHECK(e.code() == ErrorCode::kPeerFailure, << e.what());
      LOOM_CHECK(std::string(e.what()).find("rank 2 (pid") != std::string::npos, << e.what());
    }
    LOOM_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20),
               << "named only at the timeout");
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(outcomes[r].exited && outcomes[r].status == 0) << outcomes[r].output;
  }
}

// A rank that a shrink leaves out dies while the others make it, before their communicator
// has failed for it: the shrink is made (it watched its parent, whose failure for that very
// rank ended the making on every survivor).
TEST(Faults, AShrinkIsMadeWhileTheRankItLeavesOutDies) {
  const auto outcomes = testing::runRanks(3, [](RankContext& ctx) {
    CommOptions options;
    options.timeout = std::chrono::seconds(30);
    auto world = ctx.connect(options);
    world->barrier().wait();
    if (ctx.rank == 2) {
      ctx.store->get("shrinking", std::chrono::seconds(30));
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      ::_exit(0);  // without destroying its communicator: a crash
    }
    if (ctx.rank == 0) ctx.store->set("shrinking", {1});
    if (ctx.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(700));
    auto child = world->shrink(std::vector<int>{2}, options);
    float x = 1;
    child->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum).wait();
    LOOM_CHECK(x == 2.0f, << x);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(outcomes[r].exited && outcomes[r].status == 0) << outcomes[r].output;
  }
}

TEST(Faults, ExitingWithLiveCommunicatorsAndPendingOperationsDoesNotHang) {
  // std::exit runs static destructors and atexit handlers; no loom thread may hold it up,
  // even with a communicator never destroyed and a receive that can never complete.
  const auto outcomes = testing::runRanks(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    static std::shared_ptr<Communicator> leaked = comm;
    static std::vector<float> sink(16);
    // The receive is posted before the barrier: once a rank passes it, its peer may already
    // have exited (never having left the communicator), and a receive issued then would fail
    // at the call instead of staying pending.
    leaked->recv(sink.data(), sink.size(), DataType::kFloat32, 1 - ctx.rank, 99);
    comm->barrier().wait();
    std::exit(0);
  });
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

TEST(Faults, AnExceptionOutOfARankLeavesNoWaitersBehind) {
  // Rank 1 throws while rank 0 waits in a collective: unwinding destroys rank 1's
  // communicator, and rank 0 learns at once that rank 1 left without it.
  const auto outcomes = testing::runRanks(2, [](RankContext& ctx) {
    auto comm = ctx.connect(patientOptions());
    comm->barrier().wait();
    if (ctx.rank == 1) throw std::runtime_error("user code failed");
    float x = 1;
    try {
      comm->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum).wait();
      LOOM_CHECK(false, << "an all_reduce without rank 1 succeeded");
    } catch (const Error& e) {
      LOOM_CHECK(e.code() == ErrorCode::kMismatch, << e.what());
      LOOM_CHECK(std::string(e.what()).find("rank 1") != std::string::npos, << e.what());
      LOOM_CHECK(std::string(e.what()).find("destroyed its communicator") != std::string::npos,
                 << e.what());
    }
  });
  EXPECT_TRUE(outcomes[0].exited && outcomes[0].status == 0) << outcomes[0].output;
  EXPECT_TRUE(outcomes[1].exited && outcomes[1].status != 0) << outcomes[1].output;
}

TEST(Faults, APeerThatShutsDownIsNamedWhileItsHandleLives) {
  // Rank 1 shuts its communicator down (torch's destroy_process_group) but keeps the handle,
  // as Python code holding the group does, while rank 0 waits in a collective rank 1 never
  // issues: rank 0 learns that rank 1 left, not that it had not arrived by the timeout.
  const auto outcomes = testing::runRanks(2, [](RankContext& ctx) {
    auto comm = ctx.connect(patientOptions());
    comm->barrier().wait();
    if (ctx.rank == 1) {
      comm->shutdown();
      ctx.store->get("rank 0 failed", std::chrono::seconds(120));
      return;
    }
    float x = 1;
    try {
      comm->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum).wait();
      LOOM_CHECK(false, << "an all_reduce without rank 1 succeeded");
    } catch (const Error& e) {
      LOOM_CHECK(std::string(e.what()).find("rank 1") != std::string::npos, << e.what());
      LOOM_CHECK(std::string(e.what()).find("destroyed its communicator") != std::string::npos,
                 << e.what());
    }
    ctx.store->set("rank 0 failed", {1});
  });
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

// Rank 0 forks a child after making its communicator (as a Python helper that daemonises,
// or os.fork, would). The child's calls on the inherited communicator fail at once, saying
// why, and so do its wait for and cancel of a receive the parent had pending (a wait drove
// the parent's send/recv engine in the child, taking the parent's messages off the shared
// rings); its shutdown, abort and destruction leave the parent's communicator alone, and it
// exits at once (the parent's threads do not exist in it, so nothing may wait for them);
// then both ranks go on together, the parent's receive getting its message.
TEST(Faults, AForkedChildCannotUseNorTearDownItsParentsCommunicator) {
  const auto outcomes = testing::runRanks(2, [](RankContext& ctx) {
    auto comm = ctx.connect(patientOptions());
    float x = 1;
    comm->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum).wait();
    float message[4] = {};
    if (ctx.rank == 0) {
      const Request pending = comm->recv(message, 4, DataType::kFloat32, 1, 7);
      const pid_t child = ::fork();
      if (child == 0) {
        int status = 0;
        try {
          comm->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum).wait();
          status = 2;  // the child's call must not run
        } catch (const Error& e) {
          const std::string what = e.what();
          if (e.code() != ErrorCode::kUnsupported || what.find("is a fork of it") == what.npos)
            status = 3;
        }
        for (const bool cancel : {false, true}) {
          try {
            if (cancel) {
              pending.cancel();
            } else {
              pending.waitFor(std::chrono::seconds(1));
            }
            status = 6;  // it waited (or cancelled) the parent's receive
          } catch (const Error& e) {
            const std::string what = e.what();
            if (e.code() != ErrorCode::kUnsupported || what.find("a fork of") == what.npos)
              status = 7;
          }
        }
        // Nor a shrink, which works on a failed communicator (it made a communicator of its
        // own from the parent's roster, the members' hellos going to the parent's process).
        try {
          comm->shrink(std::vector<int>{1}, patientOptions());
          status = 4;
        } catch (const Error& e) {
          if (e.code() != ErrorCode::kUnsupported) status = 5;
        }
        comm->abort();
        comm->shutdown();
        comm.reset();
#if defined(__SANITIZE_ADDRESS__)
        // LeakSanitizer's check at exit would report what the parent's threads own, which a
        // fork inherits without the threads, as leaked: leave without it.
        ::_exit(status);
#else
        std::exit(status);  // runs destructors and atexit handlers, as Python's exit does
#endif
      }
      int status = -1;
      LOOM_CHECK(::waitpid(child, &status, 0) == child);
      LOOM_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, << "child status " << status);
      ctx.store->set("child gone", {1});
      pending.wait();
      LOOM_CHECK(message[0] == 7.0f && message[3] == 7.0f, << message[0]);
    } else {
      ctx.store->get("child gone", std::chrono::seconds(60));
      float sent[4] = {7, 7, 7, 7};
      comm->send(sent, 4, DataType::kFloat32, 0, 7).wait();
    }
    comm->barrier().wait();  // rank 1 waits here while rank 0's child comes and goes
    for (int i = 0; i < 3; ++i) {
      float y = static_cast<float>(ctx.rank + 1);
      comm->allReduce(&y, &y, 1, DataType::kFloat32, ReduceKind::kSum).wait();
      LOOM_CHECK(y == 3.0f, << y);
    }
  });
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

}  // namespace
}  // namespace loom
