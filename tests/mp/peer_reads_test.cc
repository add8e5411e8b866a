// Peer reads: all_to_all copying straight out of peers' memory (process_vm_readv) on real
// forked ranks, against the reference, with every input rewritten the moment its call
// returns (a rank that returned while a peer still read its input would show as a wrong
// block) and staged collectives between (all_gather, reduce_scatter, in-place all_to_all);
// turned off; only sizes in the configured range; a rank the kernel will not let read (a
// seccomp filter) making every rank stage; and a read refused mid-job failing every rank
// with an error that names the peer.

#include <gtest/gtest.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <thread>

#include "../common/expect_error.h"
#include "../common/forked_ranks.h"
#include "../common/reference.h"
#include "transport/shm/peer_reads.h"

namespace loom {
namespace {

using testing::fillInput;
using testing::firstDifference;
using testing::inputBytes;
using testing::RankContext;
using testing::referenceReduce;

TEST(PeerReadProbe, ReadsOnlyTheProcessItNames) {
  const shm::ReadProbe mine = shm::ownProbe();
  EXPECT_NE(mine.token, 0u);
  EXPECT_TRUE(shm::canReadFrom(::getpid(), mine));
  EXPECT_FALSE(shm::canReadFrom(::getpid(), {mine.address, mine.token + 1})) << "wrong token";
  EXPECT_FALSE(shm::canReadFrom(0, mine));
  // A process that has exited is no longer there to read.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_FALSE(shm::canReadFrom(child, mine));
  uint64_t word = 0;
  EXPECT_EQ(shm::readFrom(::getpid(), &word, nullptr, sizeof word), EFAULT);
}

// Makes process_vm_readv fail with EPERM in every thread of this process, as a container's
// seccomp profile or Yama's ptrace_scope would.
void refusePeerReads() {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_process_vm_readv, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog program{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
  LOOM_CHECK(::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0, << std::strerror(errno));
  LOOM_CHECK(
      ::syscall(__NR_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &program) == 0,
      << std::strerror(errno));
}

// Rounds of every peer-read collective, each input rewritten as soon as its call returns.
void checkRounds(Communicator& comm) {
  const int me = comm.rank();
  const int size = comm.size();
  uint32_t salt = 9000;
  for (DataType type : {DataType::kFloat32, DataType::kBFloat16, DataType::kInt64}) {
    const size_t es = elementSize(type);
    for (size_t count : {size_t{1}, size_t{777}, size_t{150000}}) {
      for (bool inPlace : {false, true}) {
        std::vector<uint8_t> gathered(count * es * size), own(count * es);
        std::vector<uint8_t> whole(count * es * size), block(count * es);
        std::vector<uint8_t> exchanged(count * es * size);
        for (int round = 0; round < 3; ++round) {
          ++salt;
          uint8_t* input = inPlace ? gathered.data() + me * count * es : own.data();
          fillInput(input, type, count, me, salt);
          comm.allGather(input, gathered.data(), count, type).wait();
          std::memset(input, 0xa5, count * es);  // at once: peers must be done with it
          for (int q = 0; q < size; ++q) {
            if (q == me && inPlace) continue;  // this rank's own input, just rewritten
            const auto want = inputBytes(type, count, q, salt);
            const std::string diff =
                firstDifference(gathered.data() + q * count * es, want.data(), type, count);
            LOOM_CHECK(diff.empty(), << "all_gather " << dataTypeName(type) << " count=" << count
                                     << (inPlace ? " in place" : "") << " block " << q << ": "
                                     << diff);
          }

          fillInput(whole.data(), type, count * size, me, salt);
          uint8_t* dst = inPlace ? whole.data() + me * count * es : block.data();
          comm.reduceScatter(whole.data(), dst, count, type, ReduceKind::kSum).wait();
          const auto want = referenceReduce(type, ReduceKind::kSum, count, size, salt, me * count);
          const std::string diff = firstDifference(dst, want.data(), type, count);
          LOOM_CHECK(diff.empty(), << "reduce_scatter " << dataTypeName(type) << " count=" << count
                                   << (inPlace ? " in place" : "") << ": " << diff);
          std::memset(whole.data(), 0x5a, whole.size());

          fillInput(whole.data(), type, count * size, me, salt);
          uint8_t* out = inPlace ? whole.data() : exchanged.data();
          comm.allToAll(whole.data(), out, count, type).wait();
          std::vector<uint8_t> received(out, out + whole.size());
          std::memset(whole.data(), 0x3c, whole.size());
          for (int q = 0; q < size; ++q) {
            const auto from = inputBytes(type, count, q, salt, me * count);
            const std::string d =
                firstDifference(received.data() + q * count * es, from.data(), type, count);
            LOOM_CHECK(d.empty(), << "all_to_all " << dataTypeName(type) << " count=" << count
                                  << (inPlace ? " in place" : "") << " from " << q << ": " << d);
          }
        }
      }
    }
  }
  // Per-pair counts: rank r sends (r + 2q) % 5 * 3000 elements to rank q.
  auto pairCount = [](int from, int to) { return static_cast<size_t>((from + 2 * to) % 5) * 3000; };
  std::vector<std::vector<uint8_t>> inputs, outputs;
  std::vector<const void*> in;
  std::vector<void*> out;
  std::vector<size_t> sendCounts, recvCounts;
  for (int q = 0; q < size; ++q) {
    sendCounts.push_back(pairCount(me, q));
    recvCounts.push_back(pairCount(q, me));
    inputs.push_back(inputBytes(DataType::kFloat32, sendCounts.back(), me, salt + 31 * q));
    outputs.emplace_back(recvCounts.back() * 4 + 1);
  }
  for (auto& i : inputs) in.push_back(i.data());
  for (auto& o : outputs) out.push_back(o.data());
  comm.allToAllV(in, sendCounts, out, recvCounts, DataType::kFloat32).wait();
  for (int q = 0; q < size; ++q) {
    const auto want = inputBytes(DataType::kFloat32, recvCounts[q], q, salt + 31 * me);
    LOOM_CHECK(firstDifference(out[q], want.data(), DataType::kFloat32, recvCounts[q]).empty(),
               << "all_to_all_v from " << q);
  }
}

// How many of a rank's collectives read peers: all that can, or none.
enum class Expect { kAll, kNone };

void runChecks(int size, std::vector<std::string> environment, Expect expect,
               bool rankOneRefuses = false) {
  testing::RunOptions options;
  options.environment = std::move(environment);
  options.environment.push_back("LOOM_THREADS=2");
  const auto outcomes = testing::runRanks(
      size,
      [&](RankContext& ctx) {
        if (rankOneRefuses && ctx.rank == 1) refusePeerReads();
        auto comm = ctx.connect();
        const uint64_t before = shm::peerReadCollectives();
        checkRounds(*comm);
        const uint64_t read = shm::peerReadCollectives() - before;
        // 3 types x 3 counts x 3 rounds of all_to_all out of place (in place, it stages),
        // and the V call.
        if (expect == Expect::kAll) {
          LOOM_CHECK(read == 28, << read << " of 28 collectives read peers");
        } else {
          LOOM_CHECK(read == 0, << read << " collectives read peers");
        }
      },
      options);
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

TEST(PeerReads, EveryRankReadsItsPeersAtEverySize) {
  runChecks(3, {"LOOM_PEER_READ_BYTES=0"}, Expect::kAll);
  runChecks(4, {"LOOM_PEER_READ_BYTES=0", "LOOM_CHUNK_BYTES=16K"}, Expect::kAll);
}

TEST(PeerReads, TurnedOffEveryCollectiveStages) {
  runChecks(3, {"LOOM_PEER_READ_BYTES=0", "LOOM_PEER_READS=0"}, Expect::kNone);
}

TEST(PeerReads, ARankThatMayNotReadMakesEveryRankStage) {
  runChecks(3, {"LOOM_PEER_READ_BYTES=0", "LOOM_CHUNK_BYTES=16K"}, Expect::kNone, true);
}

TEST(PeerReads, OnlyExchangesInTheConfiguredRangeReadPeers) {
  testing::RunOptions options;
  options.environment = {"LOOM_PEER_READ_BYTES=64K", "LOOM_PEER_READ_MAX_BYTES=1M"};
  const auto outcomes = testing::runRanks(
      4,
      [&](RankContext& ctx) {
        auto comm = ctx.connect();
        // Whole exchanges (4 ranks x count x 4 bytes) below, at, inside, at the end of and
        // above [64 KiB, 1 MiB).
        for (const auto& [count, reads] : std::vector<std::pair<size_t, bool>>{
                 {4095, false}, {4096, true}, {20000, true}, {65536, false}, {70000, false}}) {
          std::vector<float> in(count * 4, static_cast<float>(ctx.rank)), out(count * 4);
          const uint64_t before = shm::peerReadCollectives();
          comm->allToAll(in.data(), out.data(), count, DataType::kFloat32).wait();
          LOOM_CHECK((shm::peerReadCollectives() - before == 1) == reads, << "count " << count);
          for (int q = 0; q < 4; ++q) LOOM_CHECK(out[q * count] == static_cast<float>(q));
        }
      },
      options);
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

TEST(PeerReads, AReadRefusedMidJobFailsEveryRankNamingThePeer) {
  testing::RunOptions options;
  options.environment = {"LOOM_PEER_READ_BYTES=0"};
  const auto outcomes = testing::runRanks(
      3,
      [&](RankContext& ctx) {
        auto comm = ctx.connect();
        std::vector<float> in(3000 * 3, 1.0F), out(3000 * 3);
        comm->allToAll(in.data(), out.data(), 3000, DataType::kFloat32).wait();
        LOOM_CHECK(shm::peerReadCollectives() == 1, << "the first call did not read peers");
        // The probe passed; from now on the kernel refuses rank 1's reads.
        if (ctx.rank == 1) refusePeerReads();
        testing::expectError(
            [&] { comm->allToAll(in.data(), out.data(), 3000, DataType::kFloat32).wait(); },
            ErrorCode::kSystem, {"all_to_all", "rank 1 could not read rank", "LOOM_PEER_READS=0"});
      },
      options);
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

TEST(PeerReads, AReaderLeftBehindFailsRatherThanReturnWhatItsPeersWroteAfterTheirCalls) {
  // Rank 0 stalls right after opening its second all_to_all (LOOM_FAULT_STALL_AT), before it
  // reads its peers' inputs. Ranks 1 and 2 read and close, time out waiting for it (after
  // the 2 s in which a timeout listens for a reason), fail the communicator and rewrite their
  // inputs at once, as a caller may. Rank 0 wakes, reads the rewritten inputs and finds
  // every peer's close posted: it returned them as its result, with success, until
  // closeReads looked for the failure; now every rank's call fails.
  testing::RunOptions options;
  options.environment = {"LOOM_PEER_READ_BYTES=0"};
  const auto outcomes = testing::runRanks(
      3,
      [&](RankContext& ctx) {
        if (ctx.rank == 0) ::setenv("LOOM_FAULT_STALL_AT", "2:1:4500", 1);
        auto comm = ctx.connect();
        const size_t count = 3000;
        std::vector<float> in(count * 3, static_cast<float>(ctx.rank)), out(count * 3);
        comm->allToAll(in.data(), out.data(), count, DataType::kFloat32).wait();
        LOOM_CHECK(shm::peerReadCollectives() == 1, << "the first call did not read peers");
        OpOptions patience;
        patience.timeout = std::chrono::milliseconds(200);
        try {
          comm->allToAll(in.data(), out.data(), count, DataType::kFloat32, patience).wait();
          LOOM_CHECK(false, << "rank " << ctx.rank << "'s call succeeded; its block from rank 1 "
                            << "begins " << out[count] << " (1 was sent, 99 written after)");
        } catch (const Error& e) {
          std::fill(in.begin(), in.end(), 99.0F);  // at once
          LOOM_CHECK(e.code() == ErrorCode::kTimeout, << e.what());
          LOOM_CHECK(std::string(e.what()).find("rank 0") != std::string::npos, << e.what());
        }
        // Alive while rank 0 reads (a rank gone is a read refused, which fails it anyway).
        if (ctx.rank != 0) std::this_thread::sleep_for(std::chrono::seconds(4));
      },
      options);
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

}  // namespace
}  // namespace loom
