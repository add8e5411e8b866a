// Every collective x data type x reduction x size, on real forked ranks, in place and out of
// place, against the reference. Sizes cover 0, 1, odd, unaligned pointers, exactly one chunk,
// one past it, and more than the whole shared area (the tests shrink chunks to 16 KiB so the
// large cases stay cheap). The suite runs for several world sizes and algorithm tables.

#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <numeric>
#include <ostream>

#include "../common/forked_ranks.h"
#include "../common/reference.h"

namespace loom {
namespace {

using testing::fillInput;
using testing::firstDifference;
using testing::inputBytes;
using testing::RankContext;
using testing::referenceReduce;

constexpr size_t kChunkBytes = 16 << 10;

// The sizes every collective is tried with, in elements of `type`.
std::vector<size_t> countsFor(DataType type) {
  const size_t chunk = kChunkBytes / elementSize(type);
  return {0, 1, 7, 33, chunk, chunk + 1, 5 * chunk / 2 + 13};
}

// A buffer whose data starts one element past a 64-byte boundary when `unaligned`.
class Buffer {
 public:
  Buffer(size_t bytes, size_t shift) : storage_(bytes + 128), shift_(shift) {
    const auto base = reinterpret_cast<uintptr_t>(storage_.data());
    offset_ = (64 - base % 64) % 64 + shift_;
  }
  uint8_t* data() { return storage_.data() + offset_; }

 private:
  std::vector<uint8_t> storage_;
  size_t shift_;
  size_t offset_ = 0;
};

std::string caseName(const char* op, DataType type, size_t count, bool inPlace, int root = -1) {
  std::string s = std::string(op) + " " + std::string(dataTypeName(type)) +
                  " count=" + std::to_string(count) + (inPlace ? " in-place" : " out-of-place");
  if (root >= 0) s += " root=" + std::to_string(root);
  return s;
}

void checkAllReduce(Communicator& comm) {
  uint32_t salt = 0;
  for (DataType type : testing::allTypes()) {
    const size_t es = elementSize(type);
    for (ReduceOp op : testing::reductionsFor(type)) {
      for (size_t count : countsFor(type)) {
        for (bool inPlace : {false, true}) {
          ++salt;
          Buffer in(count * es, count % 2 ? es : 0);
          Buffer out(count * es, 0);
          fillInput(in.data(), type, count, comm.rank(), salt);
          uint8_t* dst = inPlace ? in.data() : out.data();
          comm.allReduce(in.data(), dst, count, type, op).wait();
          const auto want = referenceReduce(type, op, count, comm.size(), salt);
          const std::string diff = firstDifference(dst, want.data(), type, count);
          LOOM_CHECK(diff.empty(), << caseName("all_reduce", type, count, inPlace) << " "
                                   << reduceKindName(op.kind()) << ": " << diff);
        }
      }
    }
  }
}

void checkReduceAndBroadcast(Communicator& comm) {
  uint32_t salt = 1000;
  const int me = comm.rank();
  for (DataType type : testing::allTypes()) {
    const size_t es = elementSize(type);
    for (size_t count : countsFor(type)) {
      for (int root : {0, comm.size() - 1}) {
        for (bool inPlace : {false, true}) {
          // reduce, one reduction per case to keep the sweep short; all_reduce covers all.
          const auto ops = testing::reductionsFor(type);
          const ReduceOp op = ops[salt % ops.size()];
          ++salt;
          Buffer in(count * es, es);
          Buffer out(count * es, 0);
          fillInput(in.data(), type, count, me, salt);
          uint8_t* dst = inPlace ? in.data() : out.data();
          comm.reduce(in.data(), dst, count, type, op, root).wait();
          if (me == root) {
            const auto want = referenceReduce(type, op, count, comm.size(), salt);
            const std::string diff = firstDifference(dst, want.data(), type, count);
            LOOM_CHECK(diff.empty(), << caseName("reduce", type, count, inPlace, root) << " "
                                     << reduceKindName(op.kind()) << ": " << diff);
          }
          // broadcast of the root's input.
          ++salt;
          Buffer buf(count * es, count % 2 ? es : 0);
          Buffer src(count * es, 0);
          if (me == root) fillInput(src.data(), type, count, root, salt);
          if (inPlace && me == root) std::memcpy(buf.data(), src.data(), count * es);
          const void* input = me == root ? (inPlace ? buf.data() : src.data()) : nullptr;
          comm.broadcast(input, buf.data(), count, type, root).wait();
          const auto want = inputBytes(type, count, root, salt);
          const std::string diff = firstDifference(buf.data(), want.data(), type, count);
          LOOM_CHECK(diff.empty(),
                     << caseName("broadcast", type, count, inPlace, root) << ": " << diff);
        }
      }
    }
  }
}

void checkAllGather(Communicator& comm) {
  uint32_t salt = 2000;
  const int me = comm.rank();
  const int size = comm.size();
  for (DataType type : testing::allTypes()) {
    const size_t es = elementSize(type);
    for (size_t count : countsFor(type)) {
      for (bool inPlace : {false, true}) {
        ++salt;
        Buffer out(count * es * size, 0);
        Buffer in(count * es, es);
        uint8_t* input = inPlace ? out.data() + me * count * es : in.data();
        fillInput(input, type, count, me, salt);
        comm.allGather(input, out.data(), count, type).wait();
        const std::string diff = testing::allGatherDifference(out.data(), type, count, size, salt);
        LOOM_CHECK(diff.empty(), << caseName("all_gather", type, count, inPlace) << " " << diff);
      }
      // Per-rank counts, including ranks that contribute nothing.
      ++salt;
      std::vector<size_t> counts(static_cast<size_t>(size));
      for (int q = 0; q < size; ++q) counts[q] = q % 3 == 1 ? 0 : count + static_cast<size_t>(q);
      std::vector<std::vector<uint8_t>> outputs;
      std::vector<void*> ptrs;
      for (int q = 0; q < size; ++q) outputs.emplace_back(counts[q] * es + 1);
      for (auto& o : outputs) ptrs.push_back(o.data());
      const auto input = inputBytes(type, counts[me], me, salt);
      comm.allGatherV(input.data(), ptrs, counts, type).wait();
      for (int q = 0; q < size; ++q) {
        const auto want = inputBytes(type, counts[q], q, salt);
        const std::string diff = firstDifference(ptrs[q], want.data(), type, counts[q]);
        LOOM_CHECK(diff.empty(), << caseName("all_gather_v", type, counts[q], false) << " block "
                                 << q << ": " << diff);
      }
    }
  }
}

void checkReduceScatter(Communicator& comm) {
  uint32_t salt = 3000;
  const int me = comm.rank();
  const int size = comm.size();
  for (DataType type : testing::allTypes()) {
    const size_t es = elementSize(type);
    for (ReduceOp op : testing::reductionsFor(type)) {
      for (size_t count : countsFor(type)) {
        for (bool inPlace : {false, true}) {
          ++salt;
          // Rank r's input is elements [0, size*count) of its global input vector.
          Buffer in(count * es * size, count % 2 ? es : 0);
          Buffer out(count * es, 0);
          fillInput(in.data(), type, count * size, me, salt);
          uint8_t* dst = inPlace ? in.data() + me * count * es : out.data();
          comm.reduceScatter(in.data(), dst, count, type, op).wait();
          const auto want = referenceReduce(type, op, count, size, salt, me * count);
          const std::string diff = firstDifference(dst, want.data(), type, count);
          LOOM_CHECK(diff.empty(), << caseName("reduce_scatter", type, count, inPlace) << " "
                                   << reduceKindName(op.kind()) << ": " << diff);
        }
      }
      // Per-rank counts.
      const size_t count = countsFor(type)[3];
      ++salt;
      std::vector<size_t> counts(static_cast<size_t>(size));
      for (int q = 0; q < size; ++q) counts[q] = q % 3 == 2 ? 0 : count * (q + 1);
      std::vector<std::vector<uint8_t>> inputs;
      std::vector<const void*> ptrs;
      size_t offset = 0;
      size_t mine = 0;
      for (int q = 0; q < size; ++q) {
        inputs.push_back(inputBytes(type, counts[q], me, salt, offset));
        if (q == me) mine = offset;
        offset += counts[q];
      }
      for (auto& i : inputs) ptrs.push_back(i.data());
      std::vector<uint8_t> out(counts[me] * es + 1);
      comm.reduceScatterV(ptrs, out.data(), counts, type, op).wait();
      const auto want = referenceReduce(type, op, counts[me], size, salt, mine);
      const std::string diff = firstDifference(out.data(), want.data(), type, counts[me]);
      LOOM_CHECK(diff.empty(), << caseName("reduce_scatter_v", type, counts[me], false) << " "
                               << reduceKindName(op.kind()) << ": " << diff);
    }
  }
}

void checkAllToAll(Communicator& comm) {
  uint32_t salt = 4000;
  const int me = comm.rank();
  const int size = comm.size();
  for (DataType type : testing::allTypes()) {
    const size_t es = elementSize(type);
    for (size_t count : countsFor(type)) {
      for (bool inPlace : {false, true}) {
        ++salt;
        // Block q of rank r's input: elements [q*count, (q+1)*count) of r's global vector.
        Buffer in(count * es * size, count % 2 ? es : 0);
        Buffer out(count * es * size, 0);
        fillInput(in.data(), type, count * size, me, salt);
        uint8_t* dst = inPlace ? in.data() : out.data();
        comm.allToAll(in.data(), dst, count, type).wait();
        for (int q = 0; q < size; ++q) {
          const auto want = inputBytes(type, count, q, salt, me * count);
          const std::string diff = firstDifference(dst + q * count * es, want.data(), type, count);
          LOOM_CHECK(diff.empty(), << caseName("all_to_all", type, count, inPlace) << " from " << q
                                   << ": " << diff);
        }
      }
      // Per-pair counts: rank r sends (r + 2q) % 5 * count / 2 elements to rank q.
      ++salt;
      auto pairCount = [&](int from, int to) {
        return static_cast<size_t>((from + 2 * to) % 5) * count / 2;
      };
      std::vector<std::vector<uint8_t>> inputs, outputs;
      std::vector<const void*> in;
      std::vector<void*> out;
      std::vector<size_t> sendCounts, recvCounts;
      for (int q = 0; q < size; ++q) {
        sendCounts.push_back(pairCount(me, q));
        recvCounts.push_back(pairCount(q, me));
        inputs.push_back(inputBytes(type, sendCounts.back(), me, salt + 7919 * q));
        outputs.emplace_back(recvCounts.back() * es + 1);
      }
      for (auto& i : inputs) in.push_back(i.data());
      for (auto& o : outputs) out.push_back(o.data());
      comm.allToAllV(in, sendCounts, out, recvCounts, type).wait();
      for (int q = 0; q < size; ++q) {
        const auto want = inputBytes(type, recvCounts[q], q, salt + 7919 * me);
        const std::string diff = firstDifference(out[q], want.data(), type, recvCounts[q]);
        LOOM_CHECK(diff.empty(), << caseName("all_to_all_v", type, recvCounts[q], false) << " from "
                                 << q << ": " << diff);
      }
    }
  }
}

void checkGatherScatter(Communicator& comm) {
  uint32_t salt = 5000;
  const int me = comm.rank();
  const int size = comm.size();
  for (DataType type : testing::allTypes()) {
    const size_t es = elementSize(type);
    for (size_t count : countsFor(type)) {
      for (int root : {0, size - 1}) {
        ++salt;
        const auto input = inputBytes(type, count, me, salt);
        std::vector<std::vector<uint8_t>> outputs;
        std::vector<void*> ptrs;
        if (me == root) {
          for (int q = 0; q < size; ++q) outputs.emplace_back(count * es + 1);
          for (auto& o : outputs) ptrs.push_back(o.data());
        }
        comm.gather(input.data(), ptrs, count, type, root).wait();
        for (int q = 0; me == root && q < size; ++q) {
          const auto want = inputBytes(type, count, q, salt);
          const std::string diff = firstDifference(ptrs[q], want.data(), type, count);
          LOOM_CHECK(diff.empty(), << caseName("gather", type, count, false, root) << " from " << q
                                   << ": " << diff);
        }
        ++salt;
        std::vector<std::vector<uint8_t>> blocks;
        std::vector<const void*> sources;
        if (me == root) {
          for (int q = 0; q < size; ++q)
            blocks.push_back(inputBytes(type, count, root, salt, q * count));
          for (auto& b : blocks) sources.push_back(b.data());
        }
        std::vector<uint8_t> out(count * es + 1);
        comm.scatter(sources, out.data(), count, type, root).wait();
        const auto want = inputBytes(type, count, root, salt, me * count);
        const std::string diff = firstDifference(out.data(), want.data(), type, count);
        LOOM_CHECK(diff.empty(), << caseName("scatter", type, count, false, root) << ": " << diff);
      }
    }
  }
}

// A world size and an algorithm table.
struct Setup {
  int size;
  const char* algo;
  const char* name;
  const char* extraEnv = nullptr;  ///< one more NAME=value for the ranks
};

// How gtest (and so ctest's listing) shows a Setup: by its name, not its bytes.
void PrintTo(const Setup& setup, std::ostream* os) {
  *os << setup.name;
}

class Collectives : public ::testing::TestWithParam<Setup> {
 protected:
  testing::RunOptions options() const {
    testing::RunOptions o;
    o.environment = {"LOOM_CHUNK_BYTES=16K", std::string("LOOM_ALGO=") + GetParam().algo};
    if (GetParam().extraEnv != nullptr) o.environment.push_back(GetParam().extraEnv);
    return o;
  }
  void run(void (*check)(Communicator&)) {
    const auto outcomes = testing::runRanks(
        GetParam().size, [&](RankContext& ctx) { check(*ctx.connect()); }, options());
    const std::string report = testing::failures(outcomes);
    EXPECT_TRUE(report.empty()) << report;
  }
};

TEST_P(Collectives, AllReduce) {
  run(checkAllReduce);
}
TEST_P(Collectives, ReduceAndBroadcast) {
  run(checkReduceAndBroadcast);
}
TEST_P(Collectives, AllGather) {
  run(checkAllGather);
}
TEST_P(Collectives, ReduceScatter) {
  run(checkReduceScatter);
}
TEST_P(Collectives, AllToAll) {
  run(checkAllToAll);
}
TEST_P(Collectives, GatherScatter) {
  run(checkGatherScatter);
}

TEST_P(Collectives, BarrierWaitsForEveryRank) {
  const auto outcomes = testing::runRanks(
      GetParam().size,
      [](RankContext& ctx) {
        auto comm = ctx.connect();
        for (int round = 1; round <= 3; ++round) {
          // Late ranks arrive later; nobody may leave before everyone has arrived.
          std::this_thread::sleep_for(std::chrono::milliseconds(5 * ctx.rank));
          ctx.store->add("arrived" + std::to_string(round), 1);
          comm->barrier().wait();
          LOOM_CHECK(ctx.store->add("arrived" + std::to_string(round), 0) == ctx.size);
        }
      },
      options());
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

// Request::startedAt: a collective queued behind another starts when its worker takes it up,
// after the first has ended, not when it was issued; a send starts when it is issued.
TEST(Collectives, AQueuedCallStartsWhenTheOneBeforeItEnds) {
  const auto outcomes = testing::runRanks(2, [](RankContext& ctx) {
    using Clock = std::chrono::steady_clock;
    auto comm = ctx.connect();
    LOOM_CHECK(Request().startedAt() == Clock::time_point{});
    std::vector<float> first(4, 1.0F), second(4, 1.0F);
    comm->barrier().wait();
    if (ctx.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const Clock::time_point issued = Clock::now();
    Request a = comm->allReduce(first.data(), first.data(), first.size(), DataType::kFloat32,
                                ReduceKind::kSum);
    Request b = comm->allReduce(second.data(), second.data(), second.size(), DataType::kFloat32,
                                ReduceKind::kSum);
    Clock::time_point aEnded{};
    a.onComplete([&](const std::exception_ptr&) { aEnded = Clock::now(); });
    b.wait();
    a.wait();
    LOOM_CHECK(a.startedAt() >= issued && a.startedAt() <= aEnded);
    // On rank 0, a ends when rank 1 comes, and its callback runs on the worker before the
    // worker takes b up (on rank 1, a may end before the callback is added).
    if (ctx.rank == 0) {
      LOOM_CHECK(b.startedAt() >= aEnded, << "the second call started before the first ended");
    }
    const Clock::time_point sent = Clock::now();
    std::vector<float> message(2, 1.0F);
    Request p = ctx.rank == 0 ? comm->send(message.data(), 2, DataType::kFloat32, 1, 0)
                              : comm->recv(message.data(), 2, DataType::kFloat32, 0, 0);
    p.wait();
    LOOM_CHECK(p.startedAt() >= sent && p.startedAt() <= Clock::now());
  });
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

// A completion callback runs on the thread that finished the call (the communicator's worker
// for an asynchronous one). One that issues another collective and waits for it, or waits for
// a call queued behind its own, must not wait forever behind the call it is a callback of.
TEST(Collectives, CallbacksThatWaitForCollectivesDoNotWaitBehindThemselves) {
  const auto outcomes = testing::runRanks(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    std::vector<float> big(1 << 18, 1.0F), small(4, static_cast<float>(ctx.rank + 1));
    std::vector<float> inner(2, 1.0F);
    std::promise<void> innerDone;
    Request first =
        comm->allReduce(big.data(), big.data(), big.size(), DataType::kFloat32, ReduceKind::kSum);
    Request queued = comm->allReduce(small.data(), small.data(), small.size(), DataType::kFloat32,
                                     ReduceKind::kSum);
    first.onComplete([&](const std::exception_ptr&) {
      queued.wait();  // issued before this callback ran: queued behind `first`
      comm->allReduce(inner.data(), inner.data(), inner.size(), DataType::kFloat32,
                      ReduceKind::kSum)
          .wait();
      innerDone.set_value();
    });
    LOOM_CHECK(
        innerDone.get_future().wait_for(std::chrono::seconds(60)) == std::future_status::ready,
        << "the callback's waits never ended");
    first.wait();
    LOOM_CHECK(small == std::vector<float>(4, 3.0F) && inner == std::vector<float>(2, 2.0F));
  });
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

// A callback that waits for the call queued behind its own runs that call on the worker's
// thread, whose callback runs inside it, and so on down a long queue (PowerSGD's hooks over
// hundreds of buckets): past util/worker.h's kMaxNesting levels the callbacks wait until the
// thread is back up, so the nesting stays bounded and every call still completes.
TEST(Collectives, CallbacksOfALongQueueDoNotNestWithoutBound) {
  constexpr int kCalls = 200;
  constexpr int kMaxNesting = 8;  // Worker::kMaxNesting
  const auto outcomes = testing::runRanks(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    // Rank 1 comes late, so rank 0's worker sits in the first call while its queue fills.
    if (ctx.rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::vector<float> big(1 << 16, 1.0F);
    std::vector<std::vector<float>> small(kCalls, std::vector<float>(4));
    std::vector<Request> calls;
    calls.reserve(kCalls + 1);
    calls.push_back(
        comm->allReduce(big.data(), big.data(), big.size(), DataType::kFloat32, ReduceKind::kSum));
    for (int i = 0; i < kCalls; ++i) {
      small[i].assign(4, static_cast<float>(i + ctx.rank));
      calls.push_back(comm->allReduce(small[i].data(), small[i].data(), 4, DataType::kFloat32,
                                      ReduceKind::kSum));
    }
    std::atomic<int> nesting{0}, deepest{0}, calledBack{0};
    for (int i = 1; i < kCalls; ++i) {
      calls[i].onComplete([&, i](const std::exception_ptr&) {
        const int level = nesting.fetch_add(1) + 1;
        for (int seen = deepest.load();
             level > seen && !deepest.compare_exchange_weak(seen, level);) {
        }
        calls[i + 1].wait();  // queued behind this callback's own call
        nesting.fetch_sub(1);
        calledBack.fetch_add(1);
      });
    }
    for (Request& call : calls) call.wait();
    for (int spins = 0; calledBack.load() < kCalls - 1 && spins < 60000; ++spins) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    LOOM_CHECK(calledBack.load() == kCalls - 1, << calledBack.load() << " callbacks ran");
    LOOM_CHECK(deepest.load() <= kMaxNesting + 1,
               << "callbacks nested " << deepest.load() << " deep");
    for (int i = 0; i < kCalls; ++i) {
      LOOM_CHECK(small[i] == std::vector<float>(4, static_cast<float>(2 * i + 1)), << "call " << i);
    }
  });
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

const char* kDefaultTable = "all_reduce:one_shot:32K,two_shot:inf;reduce:one_shot:32K,two_shot:inf";

INSTANTIATE_TEST_SUITE_P(
    WorldSizes, Collectives,
    ::testing::Values(Setup{1, kDefaultTable, "P1"}, Setup{2, kDefaultTable, "P2"},
                      Setup{3, kDefaultTable, "P3"}, Setup{4, kDefaultTable, "P4"},
                      Setup{5, kDefaultTable, "P5"}, Setup{8, kDefaultTable, "P8"},
                      Setup{3, "all_reduce:one_shot:inf;reduce:one_shot:inf", "P3_OneShotOnly"},
                      Setup{3, "all_reduce:two_shot:inf;reduce:two_shot:inf", "P3_TwoShotOnly"},
                      // Every output written with streaming stores, whatever its size.
                      Setup{3, kDefaultTable, "P3_Streaming", "LOOM_STREAM_BYTES=0"},
                      // all_to_all copies out of peers' memory
                      // at every size (transport/shm/peer_reads.h).
                      Setup{2, kDefaultTable, "P2_PeerReads", "LOOM_PEER_READ_BYTES=0"},
                      Setup{3, kDefaultTable, "P3_PeerReads", "LOOM_PEER_READ_BYTES=0"},
                      Setup{5, kDefaultTable, "P5_PeerReads", "LOOM_PEER_READ_BYTES=0"}),
    [](const ::testing::TestParamInfo<Setup>& info) { return std::string(info.param.name); });

// Large messages split across helper threads (a 256 KiB chunk, three threads per rank).
TEST(CollectivesWithHelpers, LargeMessagesMatchReference) {
  testing::RunOptions options;
  options.environment = {"LOOM_CHUNK_BYTES=256K", "LOOM_THREADS=3"};
  const auto outcomes = testing::runRanks(
      3,
      [](RankContext& ctx) {
        auto comm = ctx.connect();
        uint32_t salt = 77;
        for (DataType type : {DataType::kFloat32, DataType::kBFloat16, DataType::kInt32}) {
          for (size_t count : {size_t{600000}, size_t{1} << 20}) {
            ++salt;
            std::vector<uint8_t> in = inputBytes(type, count, ctx.rank, salt);
            std::vector<uint8_t> out(in.size());
            comm->allReduce(in.data(), out.data(), count, type, ReduceKind::kSum).wait();
            const auto want = referenceReduce(type, ReduceKind::kSum, count, ctx.size, salt);
            LOOM_CHECK(firstDifference(out.data(), want.data(), type, count).empty(),
                       << dataTypeName(type) << " " << count);
            std::vector<uint8_t> gathered(in.size() * ctx.size);
            comm->allGather(in.data(), gathered.data(), count, type).wait();
            for (int q = 0; q < ctx.size; ++q) {
              const auto block = inputBytes(type, count, q, salt);
              LOOM_CHECK(std::memcmp(gathered.data() + q * in.size(), block.data(), in.size()) ==
                         0);
            }
          }
        }
      },
      options);
  EXPECT_TRUE(testing::failures(outcomes).empty()) << testing::failures(outcomes);
}

}  // namespace
}  // namespace loom
