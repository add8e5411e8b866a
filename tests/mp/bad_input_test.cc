// Bad input at every public entry point: each is refused with Error(kInvalidArgument) naming
// the operation, the argument and the rank, before anything is sent (the communicator still
// works afterwards); zero counts and a world of one give the right results.

#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "../common/expect_error.h"
#include "../common/forked_ranks.h"
#include "../common/reference.h"
#include "loom/error.h"

namespace loom {
namespace {

using testing::expectError;
using testing::expectInvalid;
using testing::RankContext;
constexpr auto kF32 = DataType::kFloat32;
constexpr auto kSum = ReduceKind::kSum;

// The communicator is still usable: a checked all_reduce of rank+1 over every rank.
void checkStillWorks(Communicator& comm) {
  const double mine = comm.rank() + 1;
  double total = 0;
  comm.allReduce(&mine, &total, 1, DataType::kFloat64, kSum).wait();
  const int p = comm.size();
  LOOM_CHECK(total == p * (p + 1) / 2.0, << "all_reduce after refused calls gave " << total);
}

TEST(BadInput, NullsTypesAndReductionsAreRefused) {
  LOOM_RUN_RANKS(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const int r = ctx.rank;
    std::vector<float> a(64), b(64);
    const auto badType = static_cast<DataType>(200);
    const auto badKind = static_cast<ReduceKind>(77);
    expectInvalid([&] { comm->allReduce(a.data(), nullptr, 4, kF32, kSum); }, "all_reduce", r,
                  {"'output' is null", "4 elements"});
    expectInvalid([&] { comm->allReduce(a.data(), b.data(), 4, kF32, badKind); }, "all_reduce", r,
                  {"'op' holds 77", "not a loom::ReduceKind"});
    expectInvalid([&] { comm->allReduce(a.data(), b.data(), 4, kF32, ReduceOp::premulSum(NAN)); },
                  "all_reduce", r, {"PREMUL_SUM factor", "finite"});
    expectInvalid(
        [&] { comm->allReduce(a.data(), b.data(), 4, kF32, ReduceOp::premulSum(INFINITY)); },
        "all_reduce", r, {"finite"});
    // A factor the device would read, with buffers in host memory: nothing could read it.
    const double factor = 0.5;
    expectInvalid(
        [&] {
          comm->reduceScatter(a.data(), b.data(), 4, kF32, ReduceOp::premulSumOnDevice(&factor));
        },
        "reduce_scatter", r, {"PREMUL_SUM factor is in device memory", "host memory"});
    expectInvalid([&] { comm->reduce(nullptr, b.data(), 4, kF32, kSum, 0); }, "reduce", r,
                  {"'input' is null"});
    expectInvalid([&] { comm->reduce(a.data(), b.data(), 4, badType, kSum, 0); }, "reduce", r,
                  {"'type' holds 200", "not a loom::DataType"});
    expectInvalid([&] { comm->broadcast(a.data(), nullptr, 4, kF32, 0); }, "broadcast", r,
                  {"'output' is null"});
    expectInvalid([&] { comm->allGather(nullptr, b.data(), 4, kF32); }, "all_gather", r,
                  {"'input' is null"});
    expectInvalid([&] { comm->allGather(a.data(), b.data(), 4, badType); }, "all_gather", r,
                  {"'type' holds 200"});
    expectInvalid([&] { comm->reduceScatter(a.data(), nullptr, 4, kF32, kSum); }, "reduce_scatter",
                  r, {"'output' is null"});
    expectInvalid([&] { comm->reduceScatter(a.data(), b.data(), 4, kF32, ReduceKind::kBitXor); },
                  "reduce_scatter", r, {"BXOR", "float32"});
    expectInvalid([&] { comm->allToAll(nullptr, b.data(), 4, kF32); }, "all_to_all", r,
                  {"'input' is null"});
    expectInvalid([&] { comm->send(nullptr, 4, kF32, 1 - r, 0); }, "send", r, {"'data' is null"});
    expectInvalid([&] { comm->recv(nullptr, 4, kF32, 1 - r, 0); }, "recv", r, {"'data' is null"});
    expectInvalid([&] { comm->send(a.data(), 4, badType, 1 - r, 0); }, "send", r, {"'type'"});
    // A null block inside a span, at the one rank that would read or write it: named with
    // its entry.
    std::vector<void*> outs{b.data(), nullptr};
    const std::vector<size_t> counts{4, 4};
    expectInvalid([&] { comm->allGatherV(a.data(), outs, counts, kF32); }, "all_gather_v", r,
                  {"'outputs[1]' is null"});
    std::vector<const void*> ins{a.data(), nullptr};
    expectInvalid([&] { comm->reduceScatterV(ins, b.data(), counts, kF32, kSum); },
                  "reduce_scatter_v", r, {"'inputs[1]' is null"});
    std::vector<void*> gatherOuts{b.data(), nullptr};
    expectInvalid([&] { comm->gather(a.data(), gatherOuts, 4, kF32, r); }, "gather", r,
                  {"'outputs[1]' is null"});
    expectInvalid([&] { comm->scatter(ins, b.data(), 4, kF32, r); }, "scatter", r,
                  {"'inputs[1]' is null"});
    expectInvalid([&] { comm->allToAllV(ins, counts, outs, counts, kF32); }, "all_to_all_v", r,
                  {"'inputs[1]' is null"});
    checkStillWorks(*comm);
  });
}

TEST(BadInput, HugeCountsAreRefused) {
  // SIZE_MAX (a negative count cast to size_t), a count whose byte size wraps size_t, and at
  // P = 8 a count that is small enough alone but whose size x count wraps.
  LOOM_RUN_RANKS(8, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const int r = ctx.rank;
    std::vector<double> a(8), b(64);
    const size_t wraps = SIZE_MAX / 8 + 2;  // x 8 bytes wraps to 8
    const size_t timesSizeWraps = SIZE_MAX / 8 + 16;
    for (size_t n : {SIZE_MAX, wraps, size_t{1} << 62}) {
      const auto t = DataType::kFloat64;
      expectInvalid([&] { comm->allReduce(a.data(), b.data(), n, t, kSum); }, "all_reduce", r,
                    {"'count' is", "cannot be in memory"});
      expectInvalid([&] { comm->reduce(a.data(), b.data(), n, t, kSum, 0); }, "reduce", r,
                    {"'count'"});
      expectInvalid([&] { comm->broadcast(a.data(), b.data(), n, t, 0); }, "broadcast", r,
                    {"'count'"});
      expectInvalid([&] { comm->allGather(a.data(), b.data(), n, t); }, "all_gather", r,
                    {"'count'"});
      expectInvalid([&] { comm->reduceScatter(a.data(), b.data(), n, t, kSum); }, "reduce_scatter",
                    r, {"'count'"});
      expectInvalid([&] { comm->allToAll(a.data(), b.data(), n, t); }, "all_to_all", r,
                    {"'count'"});
      expectInvalid([&] { comm->send(a.data(), n, t, (r + 1) % 8, 0); }, "send", r, {"'count'"});
      expectInvalid([&] { comm->recv(b.data(), n, t, (r + 1) % 8, 0); }, "recv", r, {"'count'"});
      std::vector<void*> outs(8, b.data());
      std::vector<size_t> counts(8, 0);
      counts[(r + 1) % 8] = n;
      // The errors name the list as the parameter is named, and the entry.
      const std::string entry = "[" + std::to_string((r + 1) % 8) + "]'";
      expectInvalid([&] { comm->allGatherV(a.data(), outs, counts, t); }, "all_gather_v", r,
                    {("'counts" + entry).c_str()});
      std::vector<const void*> ins(8, a.data());
      expectInvalid([&] { comm->reduceScatterV(ins, b.data(), counts, t, kSum); },
                    "reduce_scatter_v", r, {("'counts" + entry).c_str()});
      const std::vector<size_t> zeros(8, 0);
      expectInvalid([&] { comm->allToAllV(ins, counts, outs, zeros, t); }, "all_to_all_v", r,
                    {("'sendCounts" + entry).c_str()});
      expectInvalid([&] { comm->allToAllV(ins, zeros, outs, counts, t); }, "all_to_all_v", r,
                    {("'recvCounts" + entry).c_str()});
      expectInvalid([&] { comm->gather(a.data(), outs, n, t, r); }, "gather", r, {"'count'"});
      expectInvalid([&] { comm->scatter(ins, b.data(), n, t, r); }, "scatter", r, {"'count'"});
    }
    // uint8: count alone is below the limit, size x count wraps size_t.
    const auto u8 = DataType::kUInt8;
    expectInvalid([&] { comm->allGather(a.data(), b.data(), timesSizeWraps, u8); }, "all_gather", r,
                  {"'count'"});
    expectInvalid([&] { comm->reduceScatter(a.data(), b.data(), timesSizeWraps, u8, kSum); },
                  "reduce_scatter", r, {"'count'"});
    expectInvalid([&] { comm->allToAll(a.data(), b.data(), timesSizeWraps, u8); }, "all_to_all", r,
                  {"'count'"});
    checkStillWorks(*comm);
  });
}

TEST(BadInput, OverlappingBuffersAreRefused) {
  LOOM_RUN_RANKS(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const int r = ctx.rank;
    std::vector<float> a(64);
    float* p = a.data();
    expectInvalid([&] { comm->reduce(p, p + 2, 8, kF32, kSum, r); }, "reduce", r, {"overlap"});
    expectInvalid([&] { comm->broadcast(p, p + 2, 8, kF32, r); }, "broadcast", r, {"overlap"});
    expectInvalid([&] { comm->reduceScatter(p, p + 1, 8, kF32, kSum); }, "reduce_scatter", r,
                  {"'input' and 'output' overlap"});
    expectInvalid([&] { comm->allToAll(p, p + 4, 8, kF32); }, "all_to_all", r,
                  {"overlap partially"});
    const std::vector<size_t> counts{8, 8};
    std::vector<void*> outs{p + 16, p + 20};  // two outputs overlap each other
    expectInvalid([&] { comm->allGatherV(p, outs, counts, kF32); }, "all_gather_v", r,
                  {"'outputs' and 'outputs' overlap"});
    std::vector<void*> disjointOuts{p + 16, p + 32};
    expectInvalid([&] { comm->allGatherV(p + 18, disjointOuts, counts, kF32); }, "all_gather_v", r,
                  {"'input' and 'outputs' overlap"});
    std::vector<const void*> ins{p, p + 8};
    expectInvalid([&] { comm->reduceScatterV(ins, p + 4, counts, kF32, kSum); }, "reduce_scatter_v",
                  r, {"overlap"});
    std::vector<const void*> aaIns{p, p + 8};
    expectInvalid([&] { comm->allToAllV(aaIns, counts, outs, counts, kF32); }, "all_to_all_v", r,
                  {"'outputs' and 'outputs' overlap"});
    expectInvalid([&] { comm->gather(p + 17, disjointOuts, 8, kF32, r); }, "gather", r,
                  {"overlap"});
    expectInvalid([&] { comm->scatter(ins, p + 3, 8, kF32, r); }, "scatter", r, {"overlap"});
    checkStillWorks(*comm);
  });
}

TEST(BadInput, RanksRootsAndPeersOutOfRange) {
  LOOM_RUN_RANKS(3, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const int r = ctx.rank;
    std::vector<float> a(8), b(32);
    std::vector<void*> outs{b.data(), b.data() + 8, b.data() + 16};
    std::vector<const void*> ins{a.data(), a.data(), a.data()};
    for (int bad : {-1, 3, INT_MIN, INT_MAX}) {
      const std::string is = "is " + std::to_string(bad);
      const char* want = is.c_str();
      expectInvalid([&] { comm->reduce(a.data(), b.data(), 8, kF32, kSum, bad); }, "reduce", r,
                    {"'root'", want, "[0, 3)"});
      expectInvalid([&] { comm->broadcast(a.data(), b.data(), 8, kF32, bad); }, "broadcast", r,
                    {"'root'", want});
      expectInvalid([&] { comm->gather(a.data(), outs, 8, kF32, bad); }, "gather", r,
                    {"'root'", want});
      expectInvalid([&] { comm->scatter(ins, a.data(), 8, kF32, bad); }, "scatter", r,
                    {"'root'", want});
      expectInvalid([&] { comm->send(a.data(), 8, kF32, bad, 0); }, "send", r, {"'peer'", want});
      if (bad != kAnySource) {
        expectInvalid([&] { comm->recv(a.data(), 8, kF32, bad, 0); }, "recv", r, {"'peer'", want});
      }
      const std::vector<int> members{0, 1, 2, bad};
      expectInvalid([&] { comm->subset(members, "t"); }, "subset", r, {"'ranks'", want});
    }
    expectInvalid([&] { comm->recv(a.data(), 8, kF32, -2, 0); }, "recv", r, {"'peer' is -2"});
    expectInvalid([&] { comm->subset({}, "t"); }, "subset", r, {"not in 'ranks'"});
    checkStillWorks(*comm);
  });
}

TEST(BadInput, SpansOfTheWrongLength) {
  LOOM_RUN_RANKS(3, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const int r = ctx.rank;
    std::vector<float> a(8), b(64);
    std::vector<void*> outs3{b.data(), b.data() + 8, b.data() + 16};
    std::vector<const void*> ins3{a.data(), a.data(), a.data()};
    const std::vector<size_t> counts3{1, 1, 1};
    for (size_t len : {size_t{0}, size_t{2}, size_t{4}}) {
      const std::string has = "has " + std::to_string(len) + " entries";
      const char* want = has.c_str();
      std::vector<void*> outs(len, b.data() + 40);
      std::vector<const void*> ins(len, a.data());
      const std::vector<size_t> counts(len, 1);
      expectInvalid([&] { comm->allGatherV(a.data(), outs, counts3, kF32); }, "all_gather_v", r,
                    {"'outputs'", want, "one per rank (3)"});
      expectInvalid([&] { comm->allGatherV(a.data(), outs3, counts, kF32); }, "all_gather_v", r,
                    {"'counts'", want});
      expectInvalid([&] { comm->reduceScatterV(ins, b.data(), counts3, kF32, kSum); },
                    "reduce_scatter_v", r, {"'inputs'", want});
      expectInvalid([&] { comm->reduceScatterV(ins3, b.data(), counts, kF32, kSum); },
                    "reduce_scatter_v", r, {"'counts'", want});
      expectInvalid([&] { comm->allToAllV(ins, counts3, outs3, counts3, kF32); }, "all_to_all_v", r,
                    {"'inputs'", want});
      expectInvalid([&] { comm->allToAllV(ins3, counts, outs3, counts3, kF32); }, "all_to_all_v", r,
                    {"'sendCounts'", want});
      expectInvalid([&] { comm->allToAllV(ins3, counts3, outs, counts3, kF32); }, "all_to_all_v", r,
                    {"'outputs'", want});
      expectInvalid([&] { comm->allToAllV(ins3, counts3, outs3, counts, kF32); }, "all_to_all_v", r,
                    {"'recvCounts'", want});
      expectInvalid([&] { comm->gather(a.data(), outs, 1, kF32, r); }, "gather", r,
                    {"'outputs'", want});
      expectInvalid([&] { comm->scatter(ins, a.data(), 1, kF32, r); }, "scatter", r,
                    {"'inputs'", want});
    }
    checkStillWorks(*comm);
  });
}

TEST(BadInput, TimeoutsAndCreateArguments) {
  auto store = std::make_shared<HashStore>();
  auto expectCreate = [&](int rank, int size, std::shared_ptr<Store> s, CommOptions options,
                          std::initializer_list<const char*> parts) {
    try {
      Communicator::create(rank, size, s, options);
      ADD_FAILURE() << "create(" << rank << ", " << size << ") was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_EQ(e.op(), "create");
      for (const char* part : parts)
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
            << "lacks '" << part << "': " << e.what();
    }
  };
  expectCreate(-1, 2, store, {}, {"'rank' is -1", "[0, 2)"});
  expectCreate(2, 2, store, {}, {"'rank' is 2"});
  expectCreate(INT_MAX, 2, store, {}, {"'rank'"});
  expectCreate(0, 0, store, {}, {"'size' is 0", "at least 1"});
  expectCreate(0, -4, store, {}, {"'size' is -4"});
  expectCreate(0, INT_MIN, store, {}, {"'size'"});
  expectCreate(0, 1, nullptr, {}, {"'store' is null"});
  CommOptions zero, negative;
  zero.timeout = std::chrono::milliseconds(0);
  negative.timeout = std::chrono::milliseconds(-5);
  expectCreate(0, 1, store, zero, {"timeout must be positive"});
  expectCreate(0, 1, store, negative, {"timeout must be positive"});

  LOOM_RUN_RANKS(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    for (auto t : {std::chrono::milliseconds(0), std::chrono::milliseconds(-1),
                   std::chrono::milliseconds::min()}) {
      expectInvalid([&] { comm->setTimeout(t); }, "set_timeout", ctx.rank,
                    {"timeout must be positive"});
    }
    // A negative per-call timeout means "the communicator's", like zero.
    OpOptions negativeOp;
    negativeOp.timeout = std::chrono::milliseconds(-3);
    float x = 1, y = 0;
    comm->allReduce(&x, &y, 1, kF32, kSum, negativeOp).wait();
    LOOM_CHECK(y == 2.0f);
    // The largest timeouts mean "never", not a deadline that wrapped into the past.
    OpOptions forever;
    forever.timeout = std::chrono::milliseconds::max();
    comm->allReduce(&x, &y, 1, kF32, kSum, forever).wait();
    LOOM_CHECK(y == 2.0f);
    comm->setTimeout(std::chrono::milliseconds::max());
    comm->barrier().wait();
    comm->send(&x, 1, kF32, 1 - ctx.rank, 4, forever);
    comm->recv(&y, 1, kF32, 1 - ctx.rank, 4, forever).wait();
    comm->setTimeout(std::chrono::minutes(10));
    checkStillWorks(*comm);
    // Derived communicators refuse a non-positive timeout like create does.
    CommOptions bad;
    bad.timeout = std::chrono::milliseconds(0);
    const std::vector<int> both{0, 1}, other{1 - ctx.rank};
    expectInvalid([&] { comm->split(0, 0, bad); }, "split", ctx.rank, {"timeout must be positive"});
    expectInvalid([&] { comm->subset(both, "t", bad); }, "subset", ctx.rank,
                  {"timeout must be positive"});
    expectInvalid([&] { comm->shrink(other, bad); }, "shrink", ctx.rank,
                  {"timeout must be positive"});
    checkStillWorks(*comm);
  });
}

TEST(BadInput, ShrinkRefusesBadExclusionLists) {
  LOOM_RUN_RANKS(3, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const std::vector<int> none, self{ctx.rank}, outside{3},
        twice{(ctx.rank + 1) % 3, (ctx.rank + 1) % 3};
    expectInvalid([&] { comm->shrink(none); }, "shrink", ctx.rank, {"'excluded' is empty"});
    expectInvalid([&] { comm->shrink(self); }, "shrink", ctx.rank, {"is in 'excluded'"});
    expectInvalid([&] { comm->shrink(outside); }, "shrink", ctx.rank, {"'excluded'", "[0, 3)"});
    expectInvalid([&] { comm->shrink(twice); }, "shrink", ctx.rank, {"listed twice"});
    // A braced list, as RELIABILITY.md writes it.
    expectInvalid([&] { comm->shrink({ctx.rank}); }, "shrink", ctx.rank, {"is in 'excluded'"});
    // Refused with abortFirst (torch's SHRINK_ABORT) too, before anything is aborted.
    for (const auto* bad : {&none, &self, &outside, &twice}) {
      EXPECT_THROW(comm->shrink(*bad, {}, /*abortFirst=*/true), Error);
    }
    checkStillWorks(*comm);
  });
}

TEST(BadInput, DefaultRequestIsComplete) {
  const Request request;
  EXPECT_TRUE(request.test());
  EXPECT_NO_THROW(request.wait());
  EXPECT_TRUE(request.waitFor(std::chrono::milliseconds(0)));
  EXPECT_TRUE(request.waitFor(std::chrono::milliseconds(-1)));
  EXPECT_TRUE(request.waitFor(std::chrono::milliseconds::max()));
  EXPECT_EQ(request.error(), nullptr);
  EXPECT_EQ(request.sequence(), 0u);
  EXPECT_EQ(request.sourceRank(), -1);
  int calls = 0;
  std::exception_ptr seen = std::make_exception_ptr(1);
  request.onComplete([&](std::exception_ptr e) {
    ++calls;
    seen = e;
  });
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, nullptr);
}

TEST(BadInput, HashStoreArguments) {
  HashStore store;
  const auto start = std::chrono::steady_clock::now();
  for (auto t : {std::chrono::milliseconds(0), std::chrono::milliseconds(-100)}) {
    try {
      store.get("missing", t);
      ADD_FAILURE() << "get of a missing key returned";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      EXPECT_NE(std::string(e.what()).find("'missing'"), std::string::npos) << e.what();
    }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));  // no hang
  // An empty key is a key like any other here; a present key returns at once for any timeout.
  store.set("", {1, 2});
  EXPECT_EQ(store.get("", std::chrono::milliseconds(0)), (Bytes{1, 2}));
  EXPECT_EQ(store.get("", std::chrono::milliseconds::max()), (Bytes{1, 2}));
  EXPECT_TRUE(store.check(""));
  EXPECT_TRUE(store.erase(""));
  EXPECT_FALSE(store.erase(""));
  store.set("text", {'x'});
  try {
    store.add("text", 1);
    ADD_FAILURE() << "add on a non-counter succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("not a counter"), std::string::npos) << e.what();
  }
  EXPECT_EQ(store.add("n", -5), -5);
  EXPECT_EQ(store.add("n", 0), -5);
}

// Every collective at P = 1 against the reference (a world of one is a copy, or for
// reductions the reduction of one input).
TEST(BadInput, WorldOfOneGivesTheRightAnswers) {
  LOOM_RUN_RANKS(1, [](RankContext& ctx) {
    auto comm = ctx.connect();
    constexpr size_t n = 37;
    for (DataType t : testing::allTypes()) {
      const auto in = testing::inputBytes(t, n, 0, 7);
      std::vector<uint8_t> out(in.size());
      for (ReduceOp op : testing::reductionsFor(t)) {
        const auto want = testing::referenceReduce(t, op, n, 1, 7);
        comm->allReduce(in.data(), out.data(), n, t, op).wait();
        LOOM_CHECK(testing::firstDifference(out.data(), want.data(), t, n).empty(),
                   << "all_reduce " << dataTypeName(t) << " " << reduceKindName(op.kind()));
        comm->reduce(in.data(), out.data(), n, t, op, 0).wait();
        LOOM_CHECK(testing::firstDifference(out.data(), want.data(), t, n).empty());
        comm->reduceScatter(in.data(), out.data(), n, t, op).wait();
        LOOM_CHECK(testing::firstDifference(out.data(), want.data(), t, n).empty());
      }
    }
    const auto t = DataType::kInt32;
    const auto in = testing::inputBytes(t, n, 0, 9);
    auto same = [&](const std::vector<uint8_t>& got) { return got == in; };
    std::vector<uint8_t> out(in.size(), 0xAB);
    // Refills `out` in place: the block pointers below keep pointing at it.
    auto fresh = [&] { std::fill(out.begin(), out.end(), 0xAB); };
    fresh();
    comm->broadcast(in.data(), out.data(), n, t, 0).wait();
    LOOM_CHECK(same(out), << "broadcast");
    fresh();
    comm->allGather(in.data(), out.data(), n, t).wait();
    LOOM_CHECK(same(out), << "all_gather");
    fresh();
    comm->allToAll(in.data(), out.data(), n, t).wait();
    LOOM_CHECK(same(out), << "all_to_all");
    const std::vector<size_t> counts{n};
    std::vector<void*> outs{nullptr};
    std::vector<const void*> ins{in.data()};
    fresh();
    outs[0] = out.data();
    comm->allGatherV(in.data(), outs, counts, t).wait();
    LOOM_CHECK(same(out), << "all_gather_v");
    fresh();
    comm->reduceScatterV(ins, out.data(), counts, t, ReduceKind::kMax).wait();
    LOOM_CHECK(same(out), << "reduce_scatter_v");
    fresh();
    comm->allToAllV(ins, counts, outs, counts, t).wait();
    LOOM_CHECK(same(out), << "all_to_all_v");
    fresh();
    comm->gather(in.data(), outs, n, t, 0).wait();
    LOOM_CHECK(same(out), << "gather");
    fresh();
    comm->scatter(ins, out.data(), n, t, 0).wait();
    LOOM_CHECK(same(out), << "scatter");
    comm->barrier().wait();
    // In place, and a message to oneself.
    std::copy(in.begin(), in.end(), out.begin());
    comm->allReduce(out.data(), out.data(), n, t, kSum).wait();
    LOOM_CHECK(same(out), << "in-place all_reduce");
    fresh();
    Request rx = comm->recv(out.data(), n, t, 0, 5);
    comm->send(in.data(), n, t, 0, 5).wait();
    rx.wait();
    LOOM_CHECK(same(out) && rx.sourceRank() == 0, << "send to self");
    auto alone = comm->split(3, -1);
    LOOM_CHECK(alone && alone->size() == 1 && alone->rank() == 0);
    LOOM_CHECK(comm->split(-1, 0) == nullptr);
    const std::vector<int> me{0};
    auto sub = comm->subset(me, "one");
    checkStillWorks(*alone);
    checkStillWorks(*sub);
    checkStillWorks(*comm);
  });
}

// Zero counts complete on every rank, touch no output, and accept null buffers.
void zeroCounts(RankContext& ctx) {
  auto comm = ctx.connect();
  const int p = ctx.size, r = ctx.rank;
  std::vector<float> a(8, 1.0f), b(8, -7.0f);
  const std::vector<float> untouched = b;
  float* o = b.data();
  const std::vector<size_t> zeros(p, 0);
  std::vector<void*> outs(p, o), nullOuts(p, nullptr);
  std::vector<const void*> ins(p, a.data()), nullIns(p, nullptr);
  for (float* out : {o, static_cast<float*>(nullptr)}) {
    const float* in = out ? a.data() : nullptr;
    auto& os = out ? outs : nullOuts;
    auto& is = out ? ins : nullIns;
    std::vector<Request> rs;
    rs.push_back(comm->allReduce(in, out, 0, kF32, kSum));
    rs.push_back(comm->reduce(in, out, 0, kF32, ReduceKind::kMax, p - 1));
    rs.push_back(comm->broadcast(in, out, 0, kF32, p - 1));
    rs.push_back(comm->allGather(in, out, 0, kF32));
    rs.push_back(comm->allGatherV(in, os, zeros, kF32));
    rs.push_back(comm->reduceScatter(in, out, 0, kF32, kSum));
    rs.push_back(comm->reduceScatterV(is, out, zeros, kF32, kSum));
    rs.push_back(comm->allToAll(in, out, 0, kF32));
    rs.push_back(comm->allToAllV(is, zeros, os, zeros, kF32));
    rs.push_back(comm->gather(in, os, 0, kF32, 0));
    rs.push_back(comm->scatter(is, out, 0, kF32, 0));
    rs.push_back(comm->recv(out, 0, kF32, (r + p - 1) % p, 3));
    rs.push_back(comm->send(in, 0, kF32, (r + 1) % p, 3));
    for (Request& req : rs) req.wait();
    LOOM_CHECK(b == untouched, << "a zero-count call wrote to its output");
  }
  // Uneven counts with zeros: rank q contributes q elements of value q.
  std::vector<size_t> counts(p);
  std::iota(counts.begin(), counts.end(), size_t{0});
  std::vector<float> mine(r, static_cast<float>(r)), all(p * p, -1.0f);
  std::vector<void*> blocks;
  for (int q = 0; q < p; ++q) blocks.push_back(all.data() + q * p);
  comm->allGatherV(mine.data(), blocks, counts, kF32).wait();
  for (int q = 0; q < p; ++q) {
    for (int i = 0; i < p; ++i) {
      const float want = i < q ? static_cast<float>(q) : -1.0f;
      LOOM_CHECK(all[q * p + i] == want, << "all_gather_v block " << q << "[" << i << "]");
    }
  }
  checkStillWorks(*comm);
}

TEST(BadInput, ZeroCountsCompleteWithOutputsUntouchedP2) {
  LOOM_RUN_RANKS(2, zeroCounts);
}

TEST(BadInput, ZeroCountsCompleteWithOutputsUntouchedP3) {
  LOOM_RUN_RANKS(3, zeroCounts);
}

TEST(BadInput, SplitAndSubsetWithOddArguments) {
  LOOM_RUN_RANKS(3, [](RankContext& ctx) {
    auto comm = ctx.connect();
    const int r = ctx.rank;
    // Extreme keys order the members; a negative color leaves this rank out.
    const int key = r == 0 ? INT_MAX : r == 1 ? INT_MIN : 0;
    auto child = comm->split(r == 2 ? INT_MIN : 0, key);
    if (r == 2) {
      LOOM_CHECK(child == nullptr);
    } else {
      LOOM_CHECK(child && child->size() == 2 && child->rank() == (r == 1 ? 0 : 1));
      checkStillWorks(*child);
    }
    if (r != 1) checkStillWorks(*comm->subset({0, 2}, "braced"));  // a braced list
    // An empty tag is a tag like any other.
    if (r != 1) {
      const std::vector<int> pair{0, 2};
      auto sub = comm->subset(pair, "");
      LOOM_CHECK(sub->size() == 2 && sub->rank() == r / 2);
      checkStillWorks(*sub);
    }
    checkStillWorks(*comm);
  });
}

TEST(BadInput, TcpStoreArguments) {
  LOOM_RUN_RANKS(1, [](RankContext& ctx) {
    Store& store = *ctx.store;
    expectError([&] { store.get("never-set", std::chrono::milliseconds(0)); }, ErrorCode::kTimeout,
                {"'never-set'"});
    store.set("present", {4, 2});
    LOOM_CHECK(store.get("present", std::chrono::milliseconds::max()) == (Bytes{4, 2}));
    store.set("text", {'x'});
    expectError([&] { store.add("text", 1); }, ErrorCode::kInvalidArgument, {"not a counter"});
    LOOM_CHECK(store.add("n", INT64_MIN + 1) == INT64_MIN + 1);
    LOOM_CHECK(!store.check("absent") && !store.erase("absent"));
    // A timeout already past is one: it did not wrap into 49 days.
    expectError([&] { store.get("never-set", std::chrono::milliseconds(-1)); }, ErrorCode::kTimeout,
                {"'never-set'"});
    // What the server refuses is refused at the call, naming it (the server only closed the
    // connection, which read as a lost server).
    expectError([&] { store.set("", {1}); }, ErrorCode::kInvalidArgument, {"key is empty"});
    expectError([&] { store.get(std::string(5000, 'k'), std::chrono::seconds(1)); },
                ErrorCode::kInvalidArgument, {"5000 bytes", "up to 4096"});
    expectError([&] { store.set("big", Bytes((64u << 20) + 1)); }, ErrorCode::kInvalidArgument,
                {"'big'", "up to 67108864"});
    store.set("after", {7});
    LOOM_CHECK(store.get("after", std::chrono::seconds(10)) == (Bytes{7}));
    auto comm = ctx.connect();  // the store still serves the communicator's bootstrap
    checkStillWorks(*comm);
  });
}

}  // namespace
}  // namespace loom
