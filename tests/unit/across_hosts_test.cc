// The collectives across hosts on many layouts, ranks as threads (memory_hosts.h): every
// collective against the reference, bit for bit, on up to seventeen hosts (rings, recursive
// halving and doubling with and without a fold), uneven and interleaved placements, equal
// and per-rank counts, in place and out of place. The network path itself is tested between
// namespace hosts (tests/net).

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "algorithms/across_hosts.h"
#include "algorithms/rail.h"
#include "memory_hosts.h"
#include "reference.h"

namespace loom {
namespace {

using testing::fillInput;
using testing::firstDifference;
using testing::inputBytes;
using testing::MemoryHosts;
using testing::referenceReduce;

using Layout = std::vector<std::vector<int>>;

// Hosts of the given sizes, ranks numbered host by host.
Layout blocked(const std::vector<int>& sizes) {
  Layout layout;
  int next = 0;
  for (int n : sizes) {
    layout.emplace_back();
    for (int i = 0; i < n; ++i) layout.back().push_back(next++);
  }
  return layout;
}

// `hosts` hosts of `perHost` ranks, rank r on host r % hosts.
Layout interleaved(int hosts, int perHost) {
  Layout layout(static_cast<size_t>(hosts));
  for (int r = 0; r < hosts * perHost; ++r) layout[r % hosts].push_back(r);
  return layout;
}

std::string describe(const Layout& layout) {
  std::string s;
  for (const auto& host : layout) {
    s += "[";
    for (int r : host) s += std::to_string(r) + (r == host.back() ? "" : ",");
    s += "]";
  }
  return s;
}

void check(const void* got, const std::vector<uint8_t>& want, DataType type, size_t count,
           const std::string& what) {
  const std::string diff = firstDifference(got, want.data(), type, count);
  if (!diff.empty()) throw std::runtime_error(what + ": " + diff);
}

CollectiveArgs args(CollectiveKind kind, DataType type, ReduceOp op, int root, size_t count,
                    const void* input, void* output) {
  return CollectiveArgs::of(kind, type, op, root, count, input, output);
}

// Whether a reduction over n ranks of the reference's inputs (multiples of 1/8 in [-4, 4])
// is exact in any order, so the hierarchical result must equal the reference bit for bit.
// Otherwise the order of a hierarchy rounds differently from rank order (a product of
// many, or bfloat16 partial sums past 8 bits), and the result is compared within rounding.
bool exactInAnyOrder(DataType type, ReduceOp op, int n) {
  const ReduceKind k = op.kind();
  if (k == ReduceKind::kMin || k == ReduceKind::kMax) return true;
  switch (type) {
    case DataType::kFloat32: return k != ReduceKind::kProduct || n <= 4;
    case DataType::kBFloat16: return k != ReduceKind::kProduct && n <= 8;
    default: return true;  // integers wrap the same way in any order
  }
}

float valueAt(const void* p, DataType type, size_t i) {
  if (type == DataType::kFloat32) return static_cast<const float*>(p)[i];
  const uint32_t bits = uint32_t{static_cast<const uint16_t*>(p)[i]} << 16;  // bfloat16
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The result is the reference's, exactly or within rounding (see exactInAnyOrder).
void checkReduced(const void* got, const std::vector<uint8_t>& want, DataType type, ReduceOp op,
                  size_t count, int n, const std::string& what) {
  if (exactInAnyOrder(type, op, n)) return check(got, want, type, count, what);
  const float tolerance = type == DataType::kFloat32 ? 1e-5f : 2e-2f;
  for (size_t i = 0; i < count; ++i) {
    const float g = valueAt(got, type, i), w = valueAt(want.data(), type, i);
    if (std::fabs(g - w) > tolerance * std::max(1.0f, std::fabs(w))) {
      throw std::runtime_error(what + ": element " + std::to_string(i) + " is " +
                               std::to_string(g) + ", the reference " + std::to_string(w));
    }
  }
}

// Every rank holds the same bytes at `data` (compared through an all_gather of digests).
void checkSameEverywhere(AcrossHostsContext& ctx, const void* data, size_t bytes,
                         const std::string& what) {
  uint64_t digest = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < bytes; ++i) {
    digest = (digest ^ static_cast<const uint8_t*>(data)[i]) * 0x100000001b3ULL;
  }
  const int n = ctx.layout().size;
  std::vector<uint64_t> all(static_cast<size_t>(n));
  auto ag = args(CollectiveKind::kAllGather, DataType::kInt64, ReduceOp(), 0, 1, &digest, nullptr);
  for (int q = 0; q < n; ++q) ag.outputs.push_back(&all[q]);
  ag.outputCounts.assign(static_cast<size_t>(n), 1);
  runAcrossHosts(ctx, ag);
  for (int q = 0; q < n; ++q) {
    if (all[q] != digest) {
      throw std::runtime_error(what + ": rank " + std::to_string(q) + " has other bits than rank " +
                               std::to_string(ctx.layout().rank));
    }
  }
}

// Layouts that reach every pattern: rings of 2, 3, 5, 6, 7 members (and of 4 and 8 with
// blocks of 512 KiB or more: LargeAcrossHosts); halving on 4, 8, 16;
// halving with a fold on 17; one rail and several; hosts of different sizes; ranks not in
// host order; a small all_to_all's host pairs on one rail each, on several (interleaved(3,
// 6): two rails per pair) and on all of them, with rails that carry nothing ({4, 4, 4}).
std::vector<Layout> layouts() {
  return {blocked({1, 1}),
          blocked({2, 2}),
          interleaved(2, 2),
          blocked({2, 1}),
          blocked({1, 3}),
          blocked({1, 1, 1}),
          blocked({3, 1, 2}),
          blocked({2, 2, 2, 2}),
          blocked({4, 4, 4}),
          interleaved(3, 6),
          blocked({4, 5}),
          interleaved(5, 2),
          blocked({1, 2, 3, 1, 2, 1}),
          blocked(std::vector<int>(7, 1)),
          blocked(std::vector<int>(8, 1)),
          blocked(std::vector<int>(16, 1)),
          blocked(std::vector<int>(17, 1))};
}

class AcrossHosts : public ::testing::TestWithParam<Layout> {};

TEST_P(AcrossHosts, ReductionsMatchTheReference) {
  MemoryHosts hosts(GetParam());
  const int n = hosts.size();
  hosts.run([&](AcrossHostsContext& ctx) {
    const int me = ctx.layout().rank;
    uint32_t salt = 0;
    for (DataType type : {DataType::kFloat32, DataType::kBFloat16, DataType::kInt32}) {
      const size_t es = elementSize(type);
      for (ReduceOp op : testing::reductionsFor(type)) {
        if (type == DataType::kBFloat16 && op.kind() == ReduceKind::kProduct) {
          continue;  // a bfloat16 product of several of these inputs is mostly rounding
        }
        for (size_t count : {size_t{0}, size_t{1}, size_t{33}, size_t{40000}}) {
          ++salt;
          const std::string what = std::string(dataTypeName(type)) + " " +
                                   std::string(reduceKindName(op.kind())) + " count " +
                                   std::to_string(count);
          std::vector<uint8_t> in(count * es + 1), out(count * es + 1);
          fillInput(in.data(), type, count, me, salt);
          runAcrossHosts(
              ctx, args(CollectiveKind::kAllReduce, type, op, 0, count, in.data(), out.data()));
          const auto want = referenceReduce(type, op, count, n, salt);
          checkReduced(out.data(), want, type, op, count, n, "all_reduce " + what);
          checkSameEverywhere(ctx, out.data(), count * es, "all_reduce " + what);
          runAcrossHosts(
              ctx, args(CollectiveKind::kAllReduce, type, op, 0, count, in.data(), in.data()));
          checkReduced(in.data(), want, type, op, count, n, "all_reduce in place " + what);
          // reduce to the last rank
          fillInput(in.data(), type, count, me, salt);
          runAcrossHosts(
              ctx, args(CollectiveKind::kReduce, type, op, n - 1, count, in.data(), out.data()));
          if (me == n - 1) checkReduced(out.data(), want, type, op, count, n, "reduce " + what);
        }
        // reduce_scatter: equal blocks (out of place and in place) and per-rank counts
        for (size_t block : {size_t{3}, size_t{9000}}) {
          ++salt;
          std::vector<uint8_t> in(block * n * es), out(block * es + 1);
          fillInput(in.data(), type, block * n, me, salt);
          auto rs = args(CollectiveKind::kReduceScatter, type, op, 0, block, nullptr, out.data());
          for (int q = 0; q < n; ++q) rs.inputs.push_back(in.data() + q * block * es);
          rs.inputCounts.assign(static_cast<size_t>(n), block);
          runAcrossHosts(ctx, rs);
          const auto want = referenceReduce(type, op, block, n, salt, me * block);
          checkReduced(out.data(), want, type, op, block, n,
                       "reduce_scatter " + std::to_string(block));
          rs.output = in.data() + me * block * es;
          runAcrossHosts(ctx, rs);
          checkReduced(rs.output, want, type, op, block, n,
                       "reduce_scatter in place " + std::to_string(block));
        }
        ++salt;
        std::vector<size_t> counts(static_cast<size_t>(n));
        for (int q = 0; q < n; ++q)
          counts[q] = static_cast<size_t>((q * 7919) % 13 + (q % 3) * 9000);
        const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
        std::vector<uint8_t> in(total * es + 1), out(counts[me] * es + 1);
        fillInput(in.data(), type, total, me, salt);
        auto rs = args(CollectiveKind::kReduceScatter, type, op, 0, total, nullptr, out.data());
        size_t offset = 0;
        for (int q = 0; q < n; ++q) {
          rs.inputs.push_back(in.data() + offset * es);
          offset += counts[q];
        }
        rs.inputCounts = counts;
        rs.variable = true;
        runAcrossHosts(ctx, rs);
        const size_t mine = std::accumulate(counts.begin(), counts.begin() + me, size_t{0});
        checkReduced(out.data(), referenceReduce(type, op, counts[me], n, salt, mine), type, op,
                     counts[me], n, "reduce_scatter_v");
      }
    }
  });
}

TEST_P(AcrossHosts, DataMovementMatchesTheReference) {
  MemoryHosts hosts(GetParam());
  const int n = hosts.size();
  hosts.run([&](AcrossHostsContext& ctx) {
    const int me = ctx.layout().rank;
    uint32_t salt = 100;
    for (DataType type : {DataType::kFloat32, DataType::kUInt8}) {
      const size_t es = elementSize(type);
      // 2000 float32 per block: an all_to_all of 32-128 KiB per rank on 4-10 ranks, carried
      // with every rail meeting every host (smaller ones spread the hosts over the rails).
      for (size_t count : {size_t{0}, size_t{5}, size_t{2000}, size_t{40000}}) {
        ++salt;
        const std::string what =
            std::string(dataTypeName(type)) + " count " + std::to_string(count);
        for (int root : {0, n - 1, n / 2}) {
          std::vector<uint8_t> buffer(count * es + 1), in(count * es + 1);
          fillInput(in.data(), type, count, me, salt + root);
          runAcrossHosts(ctx, args(CollectiveKind::kBroadcast, type, ReduceOp(), root, count,
                                   in.data(), buffer.data()));
          check(buffer.data(), inputBytes(type, count, root, salt + root), type, count,
                "broadcast from " + std::to_string(root) + " " + what);
        }
        // all_gather, out of place and in place
        std::vector<uint8_t> in(count * es + 1), out(count * es * n + 1);
        fillInput(in.data(), type, count, me, salt);
        auto ag = args(CollectiveKind::kAllGather, type, ReduceOp(), 0, count, in.data(), nullptr);
        for (int q = 0; q < n; ++q) ag.outputs.push_back(out.data() + q * count * es);
        ag.outputCounts.assign(static_cast<size_t>(n), count);
        for (bool inPlace : {false, true}) {
          if (inPlace) {
            std::fill(out.begin(), out.end(), 0);
            fillInput(out.data() + me * count * es, type, count, me, salt);
            ag.input = out.data() + me * count * es;
          }
          runAcrossHosts(ctx, ag);
          for (int q = 0; q < n; ++q) {
            check(ag.outputs[q], inputBytes(type, count, q, salt), type, count,
                  "all_gather block " + std::to_string(q) + (inPlace ? " in place " : " ") + what);
          }
        }
        // all_to_all: block q of rank r is r's input at offset q * count
        std::vector<uint8_t> blocks(count * es * n + 1), received(count * es * n + 1);
        fillInput(blocks.data(), type, count * n, me, salt);
        auto a2a = args(CollectiveKind::kAllToAll, type, ReduceOp(), 0, count, nullptr, nullptr);
        for (int q = 0; q < n; ++q) {
          a2a.inputs.push_back(blocks.data() + q * count * es);
          a2a.outputs.push_back(received.data() + q * count * es);
        }
        a2a.inputCounts.assign(static_cast<size_t>(n), count);
        a2a.outputCounts.assign(static_cast<size_t>(n), count);
        runAcrossHosts(ctx, a2a);
        for (int q = 0; q < n; ++q) {
          check(a2a.outputs[q], inputBytes(type, count, q, salt, me * count), type, count,
                "all_to_all from " + std::to_string(q) + " " + what);
        }
        // in place (small ones go through carriers, large ones directly)
        auto same = a2a;
        same.outputs.assign(a2a.inputs.size(), nullptr);
        for (int q = 0; q < n; ++q) same.outputs[q] = const_cast<void*>(a2a.inputs[q]);
        runAcrossHosts(ctx, same);
        for (int q = 0; q < n; ++q) {
          check(same.outputs[q], inputBytes(type, count, q, salt, me * count), type, count,
                "all_to_all in place from " + std::to_string(q) + " " + what);
        }
        fillInput(blocks.data(), type, count * n, me, salt);  // the scatter below sends them
        // gather to the last rank, scatter from the first
        std::vector<uint8_t> gathered(count * es * n + 1);
        auto g = args(CollectiveKind::kGather, type, ReduceOp(), n - 1, count, in.data(), nullptr);
        for (int q = 0; q < n; ++q) g.outputs.push_back(gathered.data() + q * count * es);
        if (me != n - 1) g.outputs.clear();
        runAcrossHosts(ctx, g);
        if (me == n - 1) {
          for (int q = 0; q < n; ++q) {
            check(g.outputs[q], inputBytes(type, count, q, salt), type, count, "gather " + what);
          }
        }
        auto sc = args(CollectiveKind::kScatter, type, ReduceOp(), 0, count, nullptr, in.data());
        for (int q = 0; q < n; ++q) sc.inputs.push_back(blocks.data() + q * count * es);
        runAcrossHosts(ctx, sc);
        check(in.data(), inputBytes(type, count, 0, salt, me * count), type, count,
              "scatter " + what);
      }
    }
    // A broadcast just past the tree's bytes on every rail (the counts above stay within
    // the tree): a chain of small pieces on 3-6 hosts, too few to fill it on 7 and 8, so
    // the binomial scatter and the all-gather there.
    const DataType type = DataType::kFloat32;
    const size_t perRail = (size_t{300} << 10) / elementSize(type);
    const size_t count = perRail * static_cast<size_t>(ctx.layout().rails);
    const int hostCount = ctx.layout().hosts();
    if (hostCount > 2) {
      ASSERT_EQ(broadcastPatternFor(hostCount, perRail * elementSize(type)),
                hostCount >= 7 ? BroadcastPattern::kScatterAllGather : BroadcastPattern::kChain);
    }
    for (int root : {0, n - 1}) {
      std::vector<float> buffer(count), in(count);
      fillInput(in.data(), type, count, me, 90 + root);
      runAcrossHosts(ctx, args(CollectiveKind::kBroadcast, type, ReduceOp(), root, count, in.data(),
                               buffer.data()));
      check(buffer.data(), inputBytes(type, count, root, 90 + root), type, count,
            "broadcast past the tree from " + std::to_string(root));
    }
    // all_gather with per-rank counts, some zero
    ++salt;
    std::vector<size_t> counts(static_cast<size_t>(n));
    for (int q = 0; q < n; ++q)
      counts[q] = q % 4 == 1 ? 0 : static_cast<size_t>(q * 3001 % 17000 + 1);
    std::vector<std::vector<int32_t>> blocks(static_cast<size_t>(n));
    std::vector<void*> outputs;
    for (int q = 0; q < n; ++q) {
      blocks[q].resize(counts[q] + 1);
      outputs.push_back(blocks[q].data());
    }
    std::vector<int32_t> mine(counts[me] + 1);
    fillInput(mine.data(), DataType::kInt32, counts[me], me, salt);
    auto ag =
        args(CollectiveKind::kAllGather, DataType::kInt32, ReduceOp(), 0, 0, mine.data(), nullptr);
    ag.outputs = outputs;
    ag.outputCounts = counts;
    ag.variable = true;
    runAcrossHosts(ctx, ag);
    for (int q = 0; q < n; ++q) {
      check(outputs[q], inputBytes(DataType::kInt32, counts[q], q, salt), DataType::kInt32,
            counts[q], "all_gather_v block " + std::to_string(q));
    }
    // barrier
    runAcrossHosts(
        ctx, args(CollectiveKind::kBarrier, DataType::kUInt8, ReduceOp(), 0, 0, nullptr, nullptr));
  });
}

// Integer AVG sums past the element type's range on the way (int8: 4 ranks of 100 sum to
// 400) and must still give the exact truncated average, as one host's kernels do.
TEST(AcrossHostsAverage, NarrowIntegersDoNotWrapOnTheWay) {
  MemoryHosts hosts(blocked({2, 2}));
  hosts.run([&](AcrossHostsContext& ctx) {
    const int me = ctx.layout().rank;
    for (size_t count : {size_t{5}, size_t{100000}}) {
      std::vector<int8_t> in(count, static_cast<int8_t>(100 + me)), out(count);
      runAcrossHosts(ctx, args(CollectiveKind::kAllReduce, DataType::kInt8,
                               ReduceOp(ReduceKind::kAvg), 0, count, in.data(), out.data()));
      for (size_t i = 0; i < count; ++i) {
        if (out[i] != 101)
          throw std::runtime_error("all_reduce AVG int8: " + std::to_string(out[i]));
      }
      std::vector<int8_t> blocks(count * 4, static_cast<int8_t>(-120 - me)), mine(count);
      auto rs = args(CollectiveKind::kReduceScatter, DataType::kInt8, ReduceOp(ReduceKind::kAvg), 0,
                     count, nullptr, mine.data());
      for (int q = 0; q < 4; ++q) rs.inputs.push_back(blocks.data() + q * count);
      rs.inputCounts.assign(4, count);
      runAcrossHosts(ctx, rs);
      for (size_t i = 0; i < count; ++i) {
        if (mine[i] != -121)
          throw std::runtime_error("reduce_scatter AVG int8: " + std::to_string(mine[i]));
      }
    }
  });
}

// float16 AVG: the sum of two ranks of 40000 passes float16's largest value (65504) though
// their average does not: every rank gets 40000, not inf (each host's and each rail's partial
// sum once stored as float16). Two hosts of one rank (the pair path) and of two.
TEST(AcrossHostsAverage, HalfSumsDoNotOverflowOnTheWay) {
  constexpr uint16_t k40000 = 0x78E2;  // float16 40000
  for (const Layout& layout : {blocked({1, 1}), blocked({2, 2})}) {
    MemoryHosts hosts(layout);
    const int n = hosts.size();
    hosts.run([&](AcrossHostsContext& ctx) {
      for (size_t count : {size_t{5}, size_t{100000}}) {
        std::vector<uint16_t> in(count, k40000), out(count);
        runAcrossHosts(ctx, args(CollectiveKind::kAllReduce, DataType::kFloat16,
                                 ReduceOp(ReduceKind::kAvg), 0, count, in.data(), out.data()));
        for (uint16_t v : out) {
          if (v != k40000) throw std::runtime_error("all_reduce AVG float16: " + std::to_string(v));
        }
        std::vector<uint16_t> blocks(count * n, k40000), mine(count);
        auto rs = args(CollectiveKind::kReduceScatter, DataType::kFloat16,
                       ReduceOp(ReduceKind::kAvg), 0, count, nullptr, mine.data());
        for (int q = 0; q < n; ++q) rs.inputs.push_back(blocks.data() + q * count);
        rs.inputCounts.assign(n, count);
        runAcrossHosts(ctx, rs);
        for (uint16_t v : mine) {
          if (v != k40000)
            throw std::runtime_error("reduce_scatter AVG float16: " + std::to_string(v));
        }
      }
    });
  }
}

// 4 MiB and more go in segments (hierarchical.cc): each is a collective of its own, whose
// rail part this context runs at once (a rank alone on one of two hosts reduces its rail's
// all_reduce exchange in the segment's last step, each segment's in one of lanes + 1
// buffers). With one lane and with three (segments finish lanes after they start, in the
// same order on every rank). Up to 8 hosts (every pattern; more threads would only make the
// buffers slower to check).
class LargeAcrossHosts : public ::testing::TestWithParam<std::tuple<Layout, int>> {};

TEST_P(LargeAcrossHosts, CollectivesGoInSegments) {
  MemoryHosts hosts(std::get<0>(GetParam()), std::get<1>(GetParam()));
  const int n = hosts.size();
  hosts.run([&](AcrossHostsContext& ctx) {
    const int me = ctx.layout().rank;
    const DataType type = DataType::kFloat32;
    const size_t count = size_t{5} << 19;  // 10 MiB: five segments
    std::vector<float> in(count), out(count);
    fillInput(in.data(), type, count, me, 77);
    const ReduceOp avg(ReduceKind::kAvg);
    runAcrossHosts(ctx,
                   args(CollectiveKind::kAllReduce, type, avg, 0, count, in.data(), out.data()));
    check(out.data(), referenceReduce(type, avg, count, n, 77), type, count, "all_reduce");
    const size_t block = (size_t{9} << 20) / 4 / n + 3;  // 9 MiB in all, blocks not line-sized
    std::vector<float> blocks(block * n), mine(block);
    fillInput(blocks.data(), type, block * n, me, 78);
    auto rs = args(CollectiveKind::kReduceScatter, type, avg, 0, block, nullptr, mine.data());
    for (int q = 0; q < n; ++q) rs.inputs.push_back(blocks.data() + q * block);
    rs.inputCounts.assign(static_cast<size_t>(n), block);
    runAcrossHosts(ctx, rs);
    check(mine.data(), referenceReduce(type, avg, block, n, 78, me * block), type, block,
          "reduce_scatter");
    fillInput(mine.data(), type, block, me, 79);
    auto ag = args(CollectiveKind::kAllGather, type, ReduceOp(), 0, block, mine.data(), nullptr);
    for (int q = 0; q < n; ++q) ag.outputs.push_back(blocks.data() + q * block);
    ag.outputCounts.assign(static_cast<size_t>(n), block);
    runAcrossHosts(ctx, ag);
    for (int q = 0; q < n; ++q) {
      check(ag.outputs[q], inputBytes(type, block, q, 79), type, block,
            "all_gather block " + std::to_string(q));
    }
    fillInput(in.data(), type, count, me, 80);
    runAcrossHosts(ctx, args(CollectiveKind::kBroadcast, type, ReduceOp(), n / 2, count, in.data(),
                             out.data()));
    check(out.data(), inputBytes(type, count, n / 2, 80), type, count, "broadcast");
    // 3 MiB and a bit: one segment, or with three lanes one per lane (segmentsOverLanes).
    const size_t small = (size_t{3} << 18) + 5;
    fillInput(in.data(), type, small, me, 81);
    runAcrossHosts(ctx,
                   args(CollectiveKind::kAllReduce, type, avg, 0, small, in.data(), out.data()));
    check(out.data(), referenceReduce(type, avg, small, n, 81), type, small, "small all_reduce");
    fillInput(in.data(), type, small, me, 82);
    runAcrossHosts(ctx, args(CollectiveKind::kBroadcast, type, ReduceOp(), n - 1, small, in.data(),
                             out.data()));
    check(out.data(), inputBytes(type, small, n - 1, 82), type, small, "small broadcast");
  });
}

std::string layoutName(const ::testing::TestParamInfo<Layout>& info) {
  std::string name;
  for (char c : describe(info.param)) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return name.substr(0, 60) + "_" + std::to_string(info.index);
}

std::string layoutAndLanesName(const ::testing::TestParamInfo<std::tuple<Layout, int>>& info) {
  return layoutName({std::get<0>(info.param), info.index / 2}) + "_lanes" +
         std::to_string(std::get<1>(info.param));
}

std::vector<Layout> layoutsUpTo8Hosts() {
  std::vector<Layout> some;
  for (const Layout& l : layouts()) {
    if (l.size() <= 8) some.push_back(l);
  }
  return some;
}

INSTANTIATE_TEST_SUITE_P(Layouts, LargeAcrossHosts,
                         ::testing::Combine(::testing::ValuesIn(layoutsUpTo8Hosts()),
                                            ::testing::Values(1, 3)),
                         layoutAndLanesName);

INSTANTIATE_TEST_SUITE_P(Layouts, AcrossHosts, ::testing::ValuesIn(layouts()), layoutName);

// One rank per host: outputs back to back in host order are the rail's buffer itself (the
// rail gathers straight into them); outputs anywhere else go through the staging. Both with
// uneven blocks, the ring (3 hosts) and doubling (8 hosts), out of place and in place.
TEST(LoneRanksAllGather, IntoOneTensorOrScatteredOutputs) {
  for (int hosts : {3, 8}) {
    MemoryHosts lone(blocked(std::vector<int>(static_cast<size_t>(hosts), 1)));
    lone.run([&](AcrossHostsContext& ctx) {
      const int me = ctx.layout().rank, n = ctx.layout().size;
      const DataType type = DataType::kFloat32;
      std::vector<size_t> counts;
      for (int q = 0; q < n; ++q) counts.push_back(1000 + 37 * static_cast<size_t>(q));
      const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
      std::vector<float> in(counts[me]);
      fillInput(in.data(), type, counts[me], me, 91);
      std::vector<float> tensor(total);  // rank q's block at the sum of the counts before it
      std::vector<std::vector<float>> apart(static_cast<size_t>(n));
      for (const bool oneTensor : {true, false}) {
        for (const bool inPlace : {false, true}) {
          auto ag =
              args(CollectiveKind::kAllGather, type, ReduceOp(), 0, counts[me], in.data(), nullptr);
          size_t offset = 0;
          for (int q = 0; q < n; ++q) {
            apart[q].assign(counts[q], 0.0f);
            // Scattered: each block on its own, so no two lie back to back.
            ag.outputs.push_back(oneTensor ? tensor.data() + offset : apart[q].data());
            offset += counts[q];
          }
          std::fill(tensor.begin(), tensor.end(), 0.0f);
          if (inPlace) {
            std::copy(in.begin(), in.end(), static_cast<float*>(ag.outputs[me]));
            ag.input = ag.outputs[me];
          }
          ag.outputCounts = counts;
          runAcrossHosts(ctx, ag);
          for (int q = 0; q < n; ++q) {
            check(ag.outputs[q], inputBytes(type, counts[q], q, 91), type, counts[q],
                  std::string(oneTensor ? "one tensor" : "scattered") +
                      (inPlace ? ", in place" : "") + ": block " + std::to_string(q));
          }
        }
      }
    });
  }
}

TEST(RailPattern, RingForFewAndLargeBlocksHalvingForSmallPowersOfTwoAndMany) {
  const size_t small = 64 << 10;
  const size_t large = 512 << 10;
  EXPECT_EQ(railPatternFor(2, small), RailPattern::kRing);
  EXPECT_EQ(railPatternFor(3, small), RailPattern::kRing);
  EXPECT_EQ(railPatternFor(4, small), RailPattern::kHalving);
  EXPECT_EQ(railPatternFor(4, large - 1), RailPattern::kHalving);
  EXPECT_EQ(railPatternFor(4, large), RailPattern::kRing);
  EXPECT_EQ(railPatternFor(6, small), RailPattern::kRing);
  EXPECT_EQ(railPatternFor(8, small), RailPattern::kHalving);
  EXPECT_EQ(railPatternFor(8, large), RailPattern::kRing);
  EXPECT_EQ(railPatternFor(15, small), RailPattern::kRing);
  EXPECT_EQ(railPatternFor(16, large), RailPattern::kHalving);
  EXPECT_EQ(railPatternFor(17, small), RailPattern::kHalving);
  EXPECT_EQ(railPatternFor(2048, large), RailPattern::kHalving);
}

TEST(RailPattern, BroadcastTreeWhileSmallChainWhereItFillsElseScatterAndAllGather) {
  const size_t tree = 256 << 10, piece = 128 << 10, small = 16 << 10;
  EXPECT_EQ(broadcastPatternFor(2, size_t{64} << 20), BroadcastPattern::kTree);
  EXPECT_EQ(broadcastPatternFor(8, tree), BroadcastPattern::kTree);
  // Past the tree 3-6 members always fill a chain, in pieces of 16 KiB or more.
  EXPECT_EQ(broadcastPatternFor(3, tree + 1), BroadcastPattern::kChain);
  EXPECT_EQ(broadcastPatternFor(6, tree + 1), BroadcastPattern::kChain);
  EXPECT_EQ(broadcastPatternFor(8, 24 * small - 1), BroadcastPattern::kScatterAllGather);
  EXPECT_EQ(broadcastPatternFor(8, 24 * small), BroadcastPattern::kChain);
  EXPECT_EQ(broadcastPatternFor(8, 24 * piece), BroadcastPattern::kChain);
  EXPECT_EQ(broadcastPatternFor(10, 32 * small), BroadcastPattern::kChain);
  EXPECT_EQ(broadcastPatternFor(10, size_t{1} << 30), BroadcastPattern::kChain);  // 32 pieces
  // From 11 members the fill is more than 32 pieces: never a chain.
  EXPECT_EQ(broadcastPatternFor(11, size_t{1} << 30), BroadcastPattern::kScatterAllGather);
}

}  // namespace
}  // namespace loom
