// loom-bench's result check (bench/bench_ops.cc), on real forked ranks: for every operation,
// in and out of place, a call that moved nothing is counted wrong on some rank, and the real
// call on none. (The broadcast's and the scatter's check once passed with no call at all:
// every rank's input held the root's data, which in place is the output.)

#include <gtest/gtest.h>

#include "../common/forked_ranks.h"
#include "bench_ops.h"

namespace loom {
namespace {

using bench::BenchOp;
using testing::RankContext;

constexpr BenchOp kEvery[] = {BenchOp::kAllReduce, BenchOp::kAllGather, BenchOp::kReduceScatter,
                              BenchOp::kBroadcast, BenchOp::kAllToAll,  BenchOp::kReduce,
                              BenchOp::kGather,    BenchOp::kScatter};

// Elements counted wrong on all ranks together.
double wrongOnEveryRank(Communicator& comm, bench::OpCase& c, uint32_t salt) {
  const double mine = static_cast<double>(c.wrong(salt));
  double total = 0;
  comm.allReduce(&mine, &total, 1, DataType::kFloat64, ReduceKind::kSum).wait();
  return total;
}

TEST(BenchCheck, ACallThatMovedNothingIsWrongAndTheRealCallIsNot) {
  LOOM_RUN_RANKS(3, [](RankContext& ctx) {
    auto comm = ctx.connect();
    for (BenchOp op : kEvery) {
      for (bool inPlace : {false, true}) {
        const std::string what = std::string(bench::opName(op)) + (inPlace ? " in place" : "");
        bench::OpCase c(*comm, op, DataType::kFloat32, ReduceKind::kSum, 3 * 4096, inPlace);
        c.launch().wait();  // what the timed loop leaves behind
        c.refill(7);
        LOOM_CHECK(wrongOnEveryRank(*comm, c, 7) > 0, << what << ": no call, yet nothing wrong");
        c.refill(8);
        c.launch().wait();
        const double wrong = wrongOnEveryRank(*comm, c, 8);
        LOOM_CHECK(wrong == 0, << what << ": " << wrong << " elements wrong after the call");
      }
    }
  });
}

}  // namespace
}  // namespace loom
