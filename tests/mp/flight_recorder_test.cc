// The record of what each rank was doing: every operation appears in the flight record with
// its state; a timeout names where each laggard is and prints the per-rank progress table
// and the recent operations (or writes them to LOOM_FLIGHT_RECORDER_DUMP); desync debug
// signatures that differ across ranks fail with both quoted; LOOM_TRACE writes a timeline.

#include <gtest/gtest.h>

#include <dirent.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "../common/forked_ranks.h"
#include "loom/error.h"
#include "loom/flight_recorder.h"
#include "util/trace.h"

namespace loom {
namespace {

using testing::RankContext;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(FlightRecorder, RecordsEveryOperationWithItsState) {
  LOOM_RUN_RANKS(2, [](RankContext& ctx) {
    CommOptions options;
    options.name = "recorded";
    auto comm = ctx.connect(options);
    std::vector<float> v(16, 1.0f);
    comm->barrier().wait();
    comm->allReduce(v.data(), v.data(), 16, DataType::kFloat32, ReduceKind::kSum).wait();
    comm->broadcast(v.data(), v.data(), 16, DataType::kFloat32, 1).wait();
    if (ctx.rank == 0) {
      comm->send(v.data(), 16, DataType::kFloat32, 1, 3).wait();
    } else {
      comm->recv(v.data(), 16, DataType::kFloat32, 0, 3).wait();
    }
    std::vector<FlightRecord> mine;
    for (const FlightRecord& r : flightRecord()) {
      if (r.communicator == "recorded") mine.push_back(r);
    }
    LOOM_CHECK(mine.size() == 4, << "got " << mine.size() << " records:\n"
                                 << formatFlightRecord(mine));
    LOOM_CHECK(mine[0].operation == "barrier" && mine[0].sequence == 1);
    LOOM_CHECK(mine[1].operation == "all_reduce" && mine[1].sequence == 2);
    LOOM_CHECK(mine[1].arguments == "count 16, float32, SUM", << mine[1].arguments);
    LOOM_CHECK(mine[2].arguments == "count 16, float32, root 1", << mine[2].arguments);
    LOOM_CHECK(mine[3].operation == (ctx.rank == 0 ? "send" : "recv"), << mine[3].operation);
    LOOM_CHECK(mine[3].arguments == "peer " + std::to_string(1 - ctx.rank) + ", tag 3, 64 bytes",
               << mine[3].arguments);
    for (size_t i = 0; i < mine.size(); ++i) {
      LOOM_CHECK(mine[i].state == FlightRecord::State::kCompleted, << formatFlightRecord(mine));
      LOOM_CHECK(mine[i].rank == ctx.rank && mine[i].size == 2);
      LOOM_CHECK(i == 0 || mine[i].id > mine[i - 1].id);
      LOOM_CHECK(mine[i].error.empty());
    }
    // The table has one line per record plus a header.
    const std::string table = formatFlightRecord(mine);
    LOOM_CHECK(std::count(table.begin(), table.end(), '\n') == 5, << table);
  });
}

TEST(FlightRecorder, AWaitingReceiveRunsAndNamesAndErrorsAreKeptWhole) {
  LOOM_RUN_RANKS(2, [](RankContext& ctx) {
    // As long as torch's hashed group names (40 characters), and then some.
    const std::string name = std::string(40, 'c') + "-long-name";
    CommOptions options;
    options.name = name;
    auto comm = ctx.connect(options);
    std::vector<float> v(4, 1.0f);
    if (ctx.rank == 1) {
      // A receive waiting for its peer is running (waiting is its work), not queued.
      Request pending = comm->recv(v.data(), 4, DataType::kFloat32, 0, 5);
      const std::vector<FlightRecord> records = flightRecord();
      LOOM_CHECK(!records.empty() && records.back().operation == "recv" &&
                     records.back().state == FlightRecord::State::kRunning,
                 << formatFlightRecord(records));
      LOOM_CHECK(records.back().communicator == name, << records.back().communicator);
      ctx.store->set("looked", {1});
      pending.wait();
    } else {
      ctx.store->get("looked", std::chrono::seconds(60));
      comm->send(v.data(), 4, DataType::kFloat32, 1, 5).wait();
    }
    // Mismatched collectives: the recorded error is the whole message, both calls named.
    try {
      if (ctx.rank == 0) {
        comm->allReduce(v.data(), v.data(), 4, DataType::kFloat32, ReduceKind::kSum).wait();
      } else {
        comm->broadcast(v.data(), v.data(), 4, DataType::kFloat32, 0).wait();
      }
      LOOM_CHECK(false, << "mismatched collectives succeeded");
    } catch (const Error& e) {
      LOOM_CHECK(e.code() == ErrorCode::kMismatch, << e.what());
    }
    const FlightRecord failed = flightRecord().back();
    LOOM_CHECK(failed.state == FlightRecord::State::kFailed, << failed.error);
    LOOM_CHECK(contains(failed.error, "all_reduce") && contains(failed.error, "broadcast"),
               << failed.error);
  });
}

TEST(FlightRecorder, KeepsOnlyTheNewestEntriesAndCanBeTurnedOff) {
  testing::RunOptions small;
  small.environment = {"LOOM_FLIGHT_RECORDER=8"};
  const auto kept = testing::runRanks(
      2,
      [](RankContext& ctx) {
        auto comm = ctx.connect();
        for (int i = 0; i < 20; ++i) comm->barrier().wait();
        const auto records = flightRecord();
        LOOM_CHECK(records.size() == 8, << formatFlightRecord(records));
        LOOM_CHECK(records.back().sequence == 20 && records.front().sequence == 13,
                   << formatFlightRecord(records));
      },
      small);
  EXPECT_TRUE(testing::failures(kept).empty()) << testing::failures(kept);
  testing::RunOptions off;
  off.environment = {"LOOM_FLIGHT_RECORDER=0"};
  const auto none = testing::runRanks(
      2,
      [](RankContext& ctx) {
        auto comm = ctx.connect();
        comm->barrier().wait();
        LOOM_CHECK(flightRecord().empty());
      },
      off);
  EXPECT_TRUE(testing::failures(none).empty()) << testing::failures(none);
}

TEST(FlightRecorder, TimeoutSaysWhereEachLaggardIsAndPrintsTheRecord) {
  testing::RunOptions run;
  // Rank 1's record goes into a folder not made yet; rank 0's to a place no one can write,
  // so it prints the recent operations instead, with the reason.
  const std::string dumpFolder =
      ::testing::TempDir() + "loom_flight_" + std::to_string(::getpid()) + "/";
  const std::string dumpPrefix = dumpFolder + "fr-";
  run.environment = {"LOOM_TEST_DUMP_PREFIX=" + dumpPrefix};
  const auto outcomes = testing::runRanks(
      3,
      [](RankContext& ctx) {
        if (ctx.rank == 1)
          ::setenv("LOOM_FLIGHT_RECORDER_DUMP", std::getenv("LOOM_TEST_DUMP_PREFIX"), 1);
        if (ctx.rank == 0) ::setenv("LOOM_FLIGHT_RECORDER_DUMP", "/proc/loom-none/fr-", 1);
        auto comm = ctx.connect();
        float x = 1;
        comm->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum).wait();
        if (ctx.rank == 2) {
          // Behind: never issues collective #2 until the others have given up.
          ctx.store->get("given up", std::chrono::seconds(60));
          return;
        }
        OpOptions options;
        options.timeout = std::chrono::milliseconds(300);
        try {
          comm->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum, options).wait();
          LOOM_CHECK(false, << "the all_reduce without rank 2 succeeded");
        } catch (const Error& e) {
          LOOM_CHECK(e.code() == ErrorCode::kTimeout, << e.what());
          LOOM_CHECK(contains(e.what(), "rank 2 last started #1 and finished it"), << e.what());
        }
        // The failed call's entry says so, with its message; the one before it completed.
        const auto records = flightRecord();
        LOOM_CHECK(records.size() == 2, << formatFlightRecord(records));
        LOOM_CHECK(records[0].state == FlightRecord::State::kCompleted,
                   << formatFlightRecord(records));
        LOOM_CHECK(records[1].state == FlightRecord::State::kFailed &&
                       contains(records[1].error, "timeout"),
                   << formatFlightRecord(records));
        const std::string progress = comm->progressReport();
        LOOM_CHECK(contains(progress, "all_reduce #1"), << progress);
        if (ctx.store->add("gave up", 1) == 2) ctx.store->set("given up", {1});
      },
      run);
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
  const std::string& printed = outcomes[0].output;
  EXPECT_TRUE(contains(printed, "loom: communicator 'world' failed on rank 0 of 3")) << printed;
  EXPECT_TRUE(contains(printed, "what each rank of 'world' was doing")) << printed;
  EXPECT_TRUE(contains(printed, "(inside it)")) << printed;  // rank 0 or 1 waits in #2
  EXPECT_TRUE(contains(printed,
                       "could not write the flight record to "
                       "/proc/loom-none/fr-world.rank0.txt ("))
      << printed;
  EXPECT_TRUE(contains(printed, "last 2 operations")) << printed;
  EXPECT_TRUE(contains(printed, "running") || contains(printed, "failed")) << printed;
  // Rank 1's record went to the file, with a pointer on stderr.
  const std::string path = dumpPrefix + "world.rank1.txt";
  EXPECT_TRUE(contains(outcomes[1].output, "flight record written to " + path))
      << outcomes[1].output;
  std::ifstream file(path);
  std::stringstream dumped;
  dumped << file.rdbuf();
  EXPECT_TRUE(contains(dumped.str(), "flight record (2 operations")) << dumped.str();
  EXPECT_TRUE(contains(dumped.str(), "all_reduce")) << dumped.str();
  std::remove(path.c_str());
  ::rmdir(dumpFolder.c_str());
}

TEST(Trace, EveryProcessWritesItsTimelineAsAChromeTrace) {
  const std::string dir = ::testing::TempDir();
  const std::string name = "loom_trace_" + std::to_string(::getpid());
  testing::RunOptions run;
  // Two threads per rank, so that the 2 MiB all_reduce's copies are cut into helper parts.
  run.environment = {"LOOM_TRACE=" + dir + name, "LOOM_THREADS=2"};
  const auto outcomes = testing::runRanks(
      2,
      [](RankContext& ctx) {
        auto comm = ctx.connect();
        std::vector<float> x(1000, 1.0f);
        for (int i = 0; i < 3; ++i) {
          comm->allReduce(x.data(), x.data(), x.size(), DataType::kFloat32, ReduceKind::kSum)
              .wait();
        }
        std::vector<float> big(512 << 10, 1.0f);
        comm->allReduce(big.data(), big.data(), big.size(), DataType::kFloat32, ReduceKind::kSum)
            .wait();
        comm->barrier().wait();
        // No trace::flush() here: the communicator's end writes the timeline (ranks that
        // leave through _exit, as Python's multiprocessing children do, run no atexit).
      },
      run);
  ASSERT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
  // One file per rank process, each a Chrome trace with the collectives in it.
  int files = 0;
  DIR* d = ::opendir(dir.c_str());
  ASSERT_NE(d, nullptr);
  while (dirent* entry = ::readdir(d)) {
    const std::string file = entry->d_name;
    if (file.rfind(name + ".", 0) != 0) continue;
    ++files;
    std::ifstream in(dir + file);
    std::stringstream text;
    text << in.rdbuf();
    EXPECT_TRUE(contains(text.str(), "{\"traceEvents\":[")) << file;
    EXPECT_TRUE(contains(text.str(), "\"name\":\"all_reduce\",\"ph\":\"X\"")) << text.str();
    EXPECT_TRUE(contains(text.str(), "\"name\":\"barrier\"")) << text.str();
    // A collective's number is its size in bytes (the summary groups calls by it), and
    // every span names the CPU it began on.
    EXPECT_TRUE(contains(text.str(), "\"args\":{\"n\":4000,\"cpu\":")) << text.str();
    EXPECT_TRUE(contains(text.str(), "\"args\":{\"n\":2097152,\"cpu\":")) << text.str();
    EXPECT_FALSE(contains(text.str(), "\"cpu\":-1")) << text.str();
    // Inside a collective: its phases' waits, copies and reductions, and the helpers' parts.
    for (const char* span :
         {"phase wait", "copy", "reduction", "helper part", "wait for helpers"}) {
      EXPECT_TRUE(contains(text.str(), std::string("\"name\":\"") + span + "\"")) << span;
    }
    std::remove((dir + file).c_str());
  }
  ::closedir(d);
  EXPECT_EQ(files, 2);
}

TEST(Desync, DifferentSignaturesFailNamingBothSides) {
  LOOM_RUN_RANKS(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    std::vector<float> v(32, 1.0f);
    OpOptions options;
    options.signature = ctx.rank == 0 ? "shapes [4, 8]" : "shapes [8, 4]";
    try {
      comm->allReduce(v.data(), v.data(), 32, DataType::kFloat32, ReduceKind::kSum, options).wait();
      LOOM_CHECK(false, << "ranks with different shapes were not told");
    } catch (const Error& e) {
      LOOM_CHECK(e.code() == ErrorCode::kMismatch, << e.what());
      LOOM_CHECK(contains(e.what(), "rank 0 issued all_reduce #1 (count 32, float32, SUM"),
                 << e.what());
      LOOM_CHECK(contains(e.what(), "shapes [4, 8])"), << e.what());
      LOOM_CHECK(contains(e.what(), "rank 1 issued"), << e.what());
      LOOM_CHECK(contains(e.what(), "shapes [8, 4])"), << e.what());
    }
  });
}

TEST(Desync, ALongSignatureLeavesRoomForTheOtherRanks) {
  LOOM_RUN_RANKS(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    std::vector<float> v(4, 1.0f);
    OpOptions options;
    // Each side is quoted up to 127 characters, whichever rank detects the mismatch.
    options.signature = ctx.rank == 0 ? "shapes [" + std::string(300, '7') + "]"
                                      : std::string("shapes [3, 4] RANK1_SIGNATURE");
    try {
      comm->allReduce(v.data(), v.data(), 4, DataType::kFloat32, ReduceKind::kSum, options).wait();
      LOOM_CHECK(false, << "ranks with different signatures were not told");
    } catch (const Error& e) {
      LOOM_CHECK(e.code() == ErrorCode::kMismatch, << e.what());
      LOOM_CHECK(contains(e.what(), "shapes [3, 4] RANK1_SIGNATURE"), << e.what());
      LOOM_CHECK(contains(e.what(), "shapes [" + std::string(119, '7')), << e.what());
      LOOM_CHECK(!contains(e.what(), std::string(120, '7')), << e.what());
    }
  });
}

TEST(Desync, EqualSignaturesPass) {
  LOOM_RUN_RANKS(3, [](RankContext& ctx) {
    auto comm = ctx.connect();
    std::vector<float> v(32, 1.0f);
    OpOptions options;
    options.signature = "shapes [4, 8]";
    comm->allReduce(v.data(), v.data(), 32, DataType::kFloat32, ReduceKind::kSum, options).wait();
    LOOM_CHECK(v[0] == 3.0f);
  });
}

}  // namespace
}  // namespace loom
