// allGatherVPlaced: a gather whose counts only the calls before it learn (a count exchange),
// issued at once and placed as it starts, so an asynchronous caller never waits in between.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <vector>

#include "../common/expect_error.h"
#include "../common/forked_ranks.h"
#include "loom/error.h"
#include "loom/flight_recorder.h"

namespace loom {
namespace {

using testing::expectError;
using testing::RankContext;

// What rank q contributes: a count of its own choosing (rank 1: none), values from q.
size_t countOf(int q) {
  return q == 1 ? 0 : static_cast<size_t>(3 * q + 2);
}
int32_t valueOf(int q, size_t i) {
  return 1000 * q + static_cast<int32_t>(i);
}

// One rank's side of a sized gather: its count, every rank's counts (filled by the count
// exchange), and where every rank's elements land (made by the placement).
struct SizedGather {
  int64_t mine = 0;
  std::vector<int64_t> counts;
  std::vector<int32_t> input;
  std::vector<std::vector<int32_t>> outputs;
  int placements = 0;

  SizedGather(int rank, int size) : counts(static_cast<size_t>(size), -1) {
    mine = static_cast<int64_t>(countOf(rank));
    for (size_t i = 0; i < countOf(rank); ++i) input.push_back(valueOf(rank, i));
  }
  // Issues the count exchange and the placed gather, waiting for neither.
  std::vector<Request> issue(Communicator& comm) {
    std::vector<Request> issued;
    issued.push_back(comm.allGather(&mine, counts.data(), 1, DataType::kInt64));
    issued.push_back(comm.allGatherVPlaced(
        input.data(),
        [this] {
          ++placements;
          Communicator::Placement p;
          outputs.clear();
          for (int64_t c : counts) {
            LOOM_CHECK(c >= 0, << "placed before the count exchange ran");
            outputs.emplace_back(static_cast<size_t>(c));
          }
          for (size_t q = 0; q < counts.size(); ++q) {
            p.outputs.push_back(outputs[q].data());
            p.counts.push_back(static_cast<size_t>(counts[q]));
          }
          return p;
        },
        DataType::kInt32));
    return issued;
  }
  void check(int size) const {
    LOOM_CHECK(placements == 1, << placements);
    for (int q = 0; q < size; ++q) {
      LOOM_CHECK(outputs[q].size() == countOf(q), << q << ": " << outputs[q].size());
      for (size_t i = 0; i < countOf(q); ++i) {
        LOOM_CHECK(outputs[q][i] == valueOf(q, i), << q << "[" << i << "] " << outputs[q][i]);
      }
    }
  }
};

TEST(PlacedGather, GathersWhatOnlyTheCallBeforeItCounted) {
  testing::expectAllSucceeded(3, [](RankContext& ctx) {
    auto comm = ctx.connect();
    for (int round = 0; round < 3; ++round) {
      SizedGather g(ctx.rank, ctx.size);
      std::vector<Request> issued = g.issue(*comm);
      // A call issued after both runs after both, on every rank alike.
      int64_t one = 1, sum = 0;
      Request after = comm->allReduce(&one, &sum, 1, DataType::kInt64, ReduceKind::kSum);
      for (Request& r : issued) r.wait();
      after.wait();
      g.check(ctx.size);
      LOOM_CHECK(sum == ctx.size, << sum);
    }
    // The flight record counts what the placement gathered (0 was all it knew at issue).
    const size_t total = countOf(0) + countOf(1) + countOf(2);
    int placedGathers = 0;
    for (const FlightRecord& r : flightRecord()) {
      if (r.operation != "all_gather" || r.arguments.find("int64") != std::string::npos) continue;
      LOOM_CHECK(r.arguments == "count " + std::to_string(total) + ", int32", << r.arguments);
      ++placedGathers;
    }
    LOOM_CHECK(placedGathers == 3, << placedGathers);
    // Blocking, the calls run one after the other on the caller's thread.
    OpOptions blocking;
    blocking.blocking = true;
    SizedGather g(ctx.rank, ctx.size);
    comm->allGather(&g.mine, g.counts.data(), 1, DataType::kInt64, blocking).wait();
    g.outputs.assign(static_cast<size_t>(ctx.size), {});
    comm->allGatherVPlaced(
            g.input.data(),
            [&g] {
              ++g.placements;
              Communicator::Placement p;
              for (size_t q = 0; q < g.counts.size(); ++q) {
                g.outputs[q].resize(static_cast<size_t>(g.counts[q]));
                p.outputs.push_back(g.outputs[q].data());
                p.counts.push_back(g.outputs[q].size());
              }
              return p;
            },
            DataType::kInt32, blocking)
        .wait();
    g.check(ctx.size);
  });
}

TEST(PlacedGather, KeepsItsPlaceWhenRanksOrderTwoCommunicatorsDifferently) {
  // Rank 0 issues the sized gather on `a` and then a blocking call on `b`; rank 1 the call on
  // `b` first. Had rank 0 waited for its count exchange before placing its gather, each
  // would wait for the other until the timeout.
  testing::expectAllSucceeded(2, [](RankContext& ctx) {
    CommOptions options;
    options.timeout = std::chrono::seconds(20);
    auto a = ctx.connect(options);
    auto b = a->split(0, ctx.rank, options);
    SizedGather g(ctx.rank, ctx.size);
    float x = 1.0f;
    std::vector<Request> issued;
    if (ctx.rank == 0) {
      issued = g.issue(*a);
      b->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum).wait();
    } else {
      b->allReduce(&x, &x, 1, DataType::kFloat32, ReduceKind::kSum).wait();
      issued = g.issue(*a);
    }
    for (Request& r : issued) r.wait();
    g.check(ctx.size);
    LOOM_CHECK(x == 2.0f, << x);
  });
}

// On two ranks, a placed gather of one int32 each whose placement on rank `bad` is `badPlace`
// (the other places both into `out`) fails on both with `code` and `parts`: at the wait, or
// at the call itself where the other rank's failure came first (its peer never waits out
// the timeout for a part that never comes). Returns the failed communicator.
std::shared_ptr<Communicator> expectPlacedGatherFails(
    RankContext& ctx, int bad,
    const std::function<Communicator::Placement(std::vector<int32_t>& out)>& badPlace,
    ErrorCode code, std::initializer_list<const char*> parts) {
  CommOptions options;
  options.timeout = std::chrono::seconds(60);
  auto comm = ctx.connect(options);
  int32_t value = ctx.rank;
  std::vector<int32_t> out(2);
  const auto place = [&]() -> Communicator::Placement {
    if (ctx.rank == bad) return badPlace(out);
    return {{out.data(), out.data() + 1}, {1, 1}};
  };
  expectError([&] { comm->allGatherVPlaced(&value, place, DataType::kInt32).wait(); }, code, parts);
  return comm;
}

TEST(PlacedGather, APlacementThatThrowsFailsTheCommunicatorForEveryRank) {
  testing::expectAllSucceeded(2, [](RankContext& ctx) {
    auto comm = expectPlacedGatherFails(
        ctx, 1,
        [](std::vector<int32_t>&) -> Communicator::Placement {
          throw std::runtime_error("no room for the gather");
        },
        ErrorCode::kInternal, {"all_gather", "broke off on rank 1", "no room for the gather"});
    expectError([&] { comm->barrier().wait(); }, ErrorCode::kInternal, {"broke off on rank 1"});
  });
}

TEST(PlacedGather, APlacementAllGatherVWouldRefuseFailsTheCommunicator) {
  testing::expectAllSucceeded(2, [](RankContext& ctx) {
    expectPlacedGatherFails(ctx, 0,
                            [](std::vector<int32_t>& out) -> Communicator::Placement {
                              return {{out.data()}, {1}};  // one entry for two ranks
                            },
                            ErrorCode::kInvalidArgument,
                            {"all_gather", "broke off on rank 0", "'outputs' has 1 entries"});
  });
}

TEST(PlacedGather, IsRefusedWithoutAPlacementOrForDeviceMemory) {
  testing::expectAllSucceeded(1, [](RankContext& ctx) {
    auto comm = ctx.connect();
    int32_t value = 0;
    testing::expectInvalid([&] { comm->allGatherVPlaced(&value, nullptr, DataType::kInt32); },
                           "all_gather_v", 0, {"'place' is empty"});
    OpOptions cuda;
    cuda.device = DeviceKind::kCuda;
    expectError(
        [&] {
          comm->allGatherVPlaced(
              &value, [] { return Communicator::Placement{}; }, DataType::kInt32, cuda);
        },
        ErrorCode::kUnsupported, {"all_gather_v", "host memory only"});
    // The communicator goes on.
    std::vector<int32_t> out(1);
    comm->allGather(&value, out.data(), 1, DataType::kInt32).wait();
  });
}

}  // namespace
}  // namespace loom
