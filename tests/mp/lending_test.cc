// Lent buffers: the lending pool on its own, then all_gather and reduce_scatter on real
// forked ranks whose inputs come from it (read in place by their peers), against the
// reference: every data type and reduction, in place and out of place, per-rank counts, ranks
// that lend and ranks that do not, and inputs rewritten right after each call returns (a rank
// that returned while a peer still read its input would show as a wrong block).

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../common/forked_ranks.h"
#include "../common/lendable_buffer.h"
#include "../common/reference.h"
#include "transport/shm/lending.h"

namespace loom {
namespace {

using shm::LendingPool;
using testing::fillInput;
using testing::firstDifference;
using testing::inputBytes;
using Buffer = testing::LendableBuffer;
using testing::RankContext;
using testing::referenceReduce;

TEST(LendingPool, FindsOnlyRangesInsideLiveAllocations) {
  auto& pool = LendingPool::instance();
  auto* a = static_cast<uint8_t*>(pool.allocate(1000));
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 4096, 0u);
  const auto whole = pool.find(a, 1000);
  ASSERT_TRUE(whole.has_value());
  EXPECT_GE(whole->fd, 0);
  EXPECT_EQ(whole->offset, 0u);
  EXPECT_EQ(whole->bytes, 1000u);
  const auto inner = pool.find(a + 100, 200);
  ASSERT_TRUE(inner.has_value());
  EXPECT_EQ(inner->offset, 100u);
  EXPECT_EQ(std::memcmp(inner->id, whole->id, sizeof whole->id), 0);
  EXPECT_FALSE(pool.find(a + 100, whole->capacity).has_value()) << "runs past the region";
  int onStack = 0;
  EXPECT_FALSE(pool.find(&onStack, sizeof onStack).has_value());
  pool.release(a);
  EXPECT_FALSE(pool.find(a, 10).has_value()) << "released memory is not lent";
  // The same size again reuses the region; a much larger one does not fit it.
  const size_t held = pool.heldBytes();
  EXPECT_EQ(pool.allocate(900), a);
  EXPECT_EQ(pool.heldBytes(), held);
  auto* big = pool.allocate(size_t{3} << 20);
  EXPECT_NE(big, a);
  EXPECT_GE(pool.heldBytes(), held + (size_t{3} << 20));
  pool.release(a);
  pool.release(big);
  pool.release(big);  // twice is harmless
}

// The descriptors this process has open.
size_t openDescriptors() {
  size_t n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    (void)entry;
    ++n;
  }
  return n;
}

TEST(LendingPool, KeepsWhatTheProcessOnceUsedNotEverySizeItAskedFor) {
  // In a process of its own: the pool is the process's, and other tests fill it too.
  const pid_t child = ::fork();
  if (child == 0) {
    auto& pool = LendingPool::instance();
    const size_t fdsBefore = openDescriptors();
    // Growing sizes, one live at a time: no freed region fits the next request. Every region
    // was kept (32 regions, 1056 MiB, and a descriptor each) before.
    for (size_t mib = 2; mib <= 64; mib += 2) pool.release(pool.allocate(mib << 20));
    const bool bounded =
        pool.heldBytes() <= 2 * LendingPool::kKeptFloor && openDescriptors() <= fdsBefore + 2;
    // Many small regions live at once, then freed: at most kMaxKept stay, with their
    // descriptors, and the ones kept are reused.
    std::vector<void*> live;
    for (int i = 0; i < 200; ++i) live.push_back(pool.allocate(size_t{64} << 10));
    for (void* p : live) pool.release(p);
    const bool fewKept = openDescriptors() <= fdsBefore + LendingPool::kMaxKept + 2;
    void* again = pool.allocate(size_t{64} << 10);
    const bool reused = std::find(live.begin(), live.end(), again) != live.end();
    ::_exit((bounded ? 0 : 1) | (fewKept ? 0 : 2) | (reused ? 0 : 4));
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: too much kept of growing sizes; 2: too many small "
                                       "regions kept; 4: a kept region not reused";
}

TEST(LendingPool, AForkedChildNeverHandsOutItsParentsRegions) {
  auto& pool = LendingPool::instance();
  void* parents = pool.allocate(4096);
  pool.release(parents);  // available in the parent
  const pid_t child = ::fork();
  if (child == 0) {
    // Reusing the parent's region here would share the child's tensor with the parent.
    void* mine = pool.allocate(4096);
    const bool ok = mine != parents && !pool.find(parents, 1).has_value();
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

std::string caseName(const char* op, DataType type, size_t count, bool inPlace) {
  return std::string(op) + " " + std::string(dataTypeName(type)) +
         " count=" + std::to_string(count) + (inPlace ? " in-place" : " out-of-place");
}

// Which ranks lend their inputs in a case. kAllButRankOne: every process has lendable memory
// (so the ranks try the lent path), but rank 1 passes heap buffers (so they must stage).
enum class Lenders { kAll, kAllButRankOne, kRankZero, kNone };

bool lends(Lenders who, int rank) {
  return who == Lenders::kAll || (who == Lenders::kRankZero && rank == 0) ||
         (who == Lenders::kAllButRankOne && rank != 1);
}

void checkAllGather(Communicator& comm, Lenders who) {
  uint32_t salt = 100;
  const int me = comm.rank();
  const int size = comm.size();
  for (DataType type : testing::allTypes()) {
    const size_t es = elementSize(type);
    for (size_t count : {size_t{1}, size_t{1000}, size_t{70000}}) {
      for (bool inPlace : {false, true}) {
        Buffer out(count * es * size, lends(who, me) && inPlace);
        Buffer in(count * es, lends(who, me));
        uint8_t* input = inPlace ? out.data() + me * count * es : in.data();
        // Rounds back to back, each rewriting the input as soon as the last call returned.
        for (int round = 0; round < 3; ++round) {
          ++salt;
          fillInput(input, type, count, me, salt);
          comm.allGather(input, out.data(), count, type).wait();
          const std::string diff =
              testing::allGatherDifference(out.data(), type, count, size, salt);
          LOOM_CHECK(diff.empty(), << caseName("all_gather", type, count, inPlace) << " round "
                                   << round << " " << diff);
        }
      }
    }
  }
  // Per-rank counts from one lent buffer.
  const DataType type = DataType::kFloat32;
  std::vector<size_t> counts(static_cast<size_t>(size));
  for (int q = 0; q < size; ++q) counts[q] = q == 1 ? 0 : 5000 + 7 * static_cast<size_t>(q);
  Buffer in(counts[me] * 4 + 4, lends(who, me));
  std::vector<std::vector<uint8_t>> outputs;
  std::vector<void*> ptrs;
  for (int q = 0; q < size; ++q) outputs.emplace_back(counts[q] * 4 + 1);
  for (auto& o : outputs) ptrs.push_back(o.data());
  fillInput(in.data(), type, counts[me], me, ++salt);
  comm.allGatherV(in.data(), ptrs, counts, type).wait();
  for (int q = 0; q < size; ++q) {
    const auto want = inputBytes(type, counts[q], q, salt);
    LOOM_CHECK(firstDifference(ptrs[q], want.data(), type, counts[q]).empty(),
               << "all_gather_v block " << q);
  }
}

void checkReduceScatter(Communicator& comm, Lenders who) {
  uint32_t salt = 500;
  const int me = comm.rank();
  const int size = comm.size();
  for (DataType type : testing::allTypes()) {
    const size_t es = elementSize(type);
    for (ReduceOp op : testing::reductionsFor(type)) {
      for (size_t count : {size_t{3}, size_t{40000}}) {
        for (bool inPlace : {false, true}) {
          Buffer in(count * es * size, lends(who, me));
          Buffer out(count * es, false);
          uint8_t* dst = inPlace ? in.data() + me * count * es : out.data();
          for (int round = 0; round < 2; ++round) {
            ++salt;
            fillInput(in.data(), type, count * size, me, salt);
            comm.reduceScatter(in.data(), dst, count, type, op).wait();
            const auto want = referenceReduce(type, op, count, size, salt, me * count);
            const std::string diff = firstDifference(dst, want.data(), type, count);
            LOOM_CHECK(diff.empty(), << caseName("reduce_scatter", type, count, inPlace) << " "
                                     << reduceKindName(op.kind()) << " round " << round << ": "
                                     << diff);
          }
        }
      }
    }
  }
  // Per-rank counts, blocks end to end in one lent buffer.
  const DataType type = DataType::kFloat32;
  const ReduceOp op = ReduceKind::kSum;
  std::vector<size_t> counts(static_cast<size_t>(size));
  size_t total = 0, mine = 0;
  for (int q = 0; q < size; ++q) {
    counts[q] = q == 2 ? 0 : 3000 * static_cast<size_t>(q + 1);
    if (q == me) mine = total;
    total += counts[q];
  }
  Buffer in(total * 4, lends(who, me));
  fillInput(in.data(), type, total, me, ++salt);
  std::vector<const void*> ptrs;
  for (int q = 0, at = 0; q < size; at += static_cast<int>(counts[q]), ++q) {
    ptrs.push_back(in.data() + static_cast<size_t>(at) * 4);
  }
  std::vector<uint8_t> out(counts[me] * 4 + 1);
  comm.reduceScatterV(ptrs, out.data(), counts, type, op).wait();
  const auto want = referenceReduce(type, op, counts[me], size, salt, mine);
  LOOM_CHECK(firstDifference(out.data(), want.data(), type, counts[me]).empty(),
             << "reduce_scatter_v");
}

struct LendSetup {
  int size;
  Lenders who;
  const char* name;
  bool streaming = false;  ///< outputs written with streaming stores from any size
};

class Lending : public ::testing::TestWithParam<LendSetup> {};

TEST_P(Lending, CollectivesMatchReference) {
  const LendSetup setup = GetParam();
  testing::RunOptions options;
  // Every size lends (the default starts at 1 MiB); 16 KiB chunks, so the staged fallback
  // runs several chunks too.
  options.environment = {"LOOM_LEND_BYTES=0", "LOOM_CHUNK_BYTES=16K", "LOOM_THREADS=2"};
  if (setup.streaming) options.environment.push_back("LOOM_STREAM_BYTES=0");
  const auto outcomes = testing::runRanks(
      setup.size,
      [&](RankContext& ctx) {
        auto comm = ctx.connect();
        if (setup.who == Lenders::kAllButRankOne) {
          LendingPool::instance().release(LendingPool::instance().allocate(1));
        }
        const uint64_t before = shm::lentCollectives();
        checkAllGather(*comm, setup.who);
        checkReduceScatter(*comm, setup.who);
        const uint64_t lent = shm::lentCollectives() - before;
        // Nearly every call read in place when all ranks lent (not the first: ranks learn
        // that all can lend at an opening), none when some rank did not.
        if (setup.who == Lenders::kAll) {
          LOOM_CHECK(lent > 100, << "only " << lent << " collectives read lent inputs");
        } else {
          LOOM_CHECK(lent == 0, << lent << " collectives read lent inputs");
        }
      },
      options);
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

// This process's read-only mappings of lent regions: its peers' (its own are read-write).
size_t peersRegionsMapped() {
  std::ifstream maps("/proc/self/maps");
  size_t n = 0;
  for (std::string line; std::getline(maps, line);) {
    std::istringstream fields(line);
    std::string range, perms;
    fields >> range >> perms;
    n += perms == "r--s" && line.find("loom-lending-pool") != std::string::npos;
  }
  return n;
}

// A peer's pool turning over: rounds of 80 lent inputs freed after their calls, of which the
// pool keeps 64 and lets 16 go for good. A rank drops its mappings of those before its next
// call maps new regions, so it holds the 80 regions of a round at most; it kept every region
// ever lent before (up to 256 per communicator, resident, however large).
TEST(LentMappings, RegionsAPeerLetGoOfAreUnmappedBeforeTheNextCall) {
  testing::RunOptions options;
  options.environment = {"LOOM_LEND_BYTES=0"};
  const auto outcomes = testing::runRanks(
      2,
      [&](RankContext& ctx) {
        auto comm = ctx.connect();
        auto& pool = LendingPool::instance();
        constexpr size_t kBytes = size_t{64} << 10;
        std::vector<uint8_t> out(2 * kBytes);
        size_t most = 0;
        for (int round = 0; round < 4; ++round) {
          std::vector<void*> inputs;
          for (int i = 0; i < 80; ++i) inputs.push_back(pool.allocate(kBytes));
          for (void* in : inputs) comm->allGather(in, out.data(), kBytes, DataType::kUInt8).wait();
          most = std::max(most, peersRegionsMapped());
          comm->barrier().wait();  // the peer is done reading before these are freed
          for (void* in : inputs) pool.release(in);
          comm->barrier().wait();
        }
        LOOM_CHECK(most <= 80, << most << " of the peer's regions mapped at once");
      },
      options);
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, Lending,
    ::testing::Values(LendSetup{2, Lenders::kAll, "P2_AllLend"},
                      LendSetup{3, Lenders::kAll, "P3_AllLend"},
                      LendSetup{4, Lenders::kAll, "P4_AllLend"},
                      LendSetup{3, Lenders::kAll, "P3_AllLend_Streaming", true},
                      LendSetup{3, Lenders::kAllButRankOne, "P3_AllButRankOneLend"},
                      LendSetup{3, Lenders::kRankZero, "P3_RankZeroLends"},
                      LendSetup{3, Lenders::kNone, "P3_NoneLend"}),
    [](const ::testing::TestParamInfo<LendSetup>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace loom
