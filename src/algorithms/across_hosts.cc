// Collectives across hosts: the context's memory operations, direct all_to_all, the
// collectives derived from the hierarchical ones, and the dispatch.

#include "algorithms/across_hosts.h"

#include <algorithm>
#include <cstring>

#include "algorithms/hierarchical.h"
#include "kernels/half.h"
#include "loom/error.h"
#include "util/trace.h"

namespace loom {

HostLayout HostLayout::of(std::vector<std::vector<int>> ranksOn, int rank) {
  HostLayout layout;
  layout.rank = rank;
  layout.rails = INT32_MAX;
  for (int h = 0; h < static_cast<int>(ranksOn.size()); ++h) {
    const auto& ranks = ranksOn[h];
    const auto it = std::find(ranks.begin(), ranks.end(), rank);
    if (it != ranks.end()) {
      layout.host = h;
      layout.localIndex = static_cast<int>(it - ranks.begin());
    }
    layout.size += static_cast<int>(ranks.size());
    layout.rails = std::min(layout.rails, static_cast<int>(ranks.size()));
  }
  layout.ranksOn = std::move(ranksOn);
  return layout;
}

uint8_t* ScratchArena::take(size_t bytes) {
  if (used_ == buffers_.size()) buffers_.emplace_back();
  std::vector<uint8_t>& buffer = buffers_[used_++];
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

void AcrossHostsContext::forward(const NetTransfer& send, const NetTransfer& receive) {
  exchange({&send, 1}, {&receive, 1});
}

void AcrossHostsContext::ring(std::span<const RingStep> steps, const kernels::ReduceSpec& spec) {
  const size_t es = elementSize(spec.type);
  for (const RingStep& step : steps) {
    exchange({&step.send, 1}, {&step.receive, 1});
    if (step.into == nullptr) continue;
    const void* srcs[2] = {step.into, step.receive.data};
    reduce(step.into, srcs, step.receive.bytes / es, spec);
  }
}

void AcrossHostsContext::reduce(void* dst, std::span<const void* const> srcs, size_t count,
                                const kernels::ReduceSpec& spec) {
  if (count == 0) return;
  const trace::Span span("reduction", count * elementSize(spec.type));
  kernels::reduce(dst, srcs.data(), static_cast<int>(srcs.size()), count, spec);
}

void AcrossHostsContext::copy(void* dst, const void* src, size_t bytes) {
  if (bytes != 0 && dst != src) std::memcpy(dst, src, bytes);
}

void AcrossHostsContext::zero(void* dst, size_t bytes) {
  if (bytes != 0) std::memset(dst, 0, bytes);
}

namespace {

template <class To, class From>
void convertAs(void* dst, const void* src, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    static_cast<To*>(dst)[i] = static_cast<To>(static_cast<const From*>(src)[i]);
  }
}

template <class To>
void convertTo(void* dst, const void* src, DataType from, size_t count) {
  switch (from) {
    case DataType::kInt8: return convertAs<To, int8_t>(dst, src, count);
    case DataType::kUInt8: return convertAs<To, uint8_t>(dst, src, count);
    case DataType::kInt16: return convertAs<To, int16_t>(dst, src, count);
    case DataType::kInt32: return convertAs<To, int32_t>(dst, src, count);
    case DataType::kInt64: return convertAs<To, int64_t>(dst, src, count);
    default: throw Error(ErrorCode::kInternal, "convert", -1, "not an integer type");
  }
}

}  // namespace

void AcrossHostsContext::convert(void* dst, DataType to, const void* src, DataType from,
                                 size_t count) {
  if (from == DataType::kFloat16 && to == DataType::kFloat32) {
    const auto* in = static_cast<const uint16_t*>(src);
    auto* out = static_cast<float*>(dst);
    for (size_t i = 0; i < count; ++i) out[i] = kernels::fp16ToFloat(in[i]);
    return;
  }
  if (from == DataType::kFloat32 && to == DataType::kFloat16) {
    const auto* in = static_cast<const float*>(src);
    auto* out = static_cast<uint16_t*>(dst);
    for (size_t i = 0; i < count; ++i) out[i] = kernels::floatToFp16(in[i]);
    return;
  }
  switch (to) {
    case DataType::kInt8: return convertTo<int8_t>(dst, src, from, count);
    case DataType::kUInt8: return convertTo<uint8_t>(dst, src, from, count);
    case DataType::kInt16: return convertTo<int16_t>(dst, src, from, count);
    case DataType::kInt32: return convertTo<int32_t>(dst, src, from, count);
    case DataType::kInt64: return convertTo<int64_t>(dst, src, from, count);
    default: throw Error(ErrorCode::kInternal, "convert", -1, "not an integer type");
  }
}

uint8_t* AcrossHostsContext::scratch(size_t bytes) {
  return arena_.take(bytes);
}

size_t AcrossHostsContext::startRail(RailSteps steps, int /*lane*/) {
  std::exception_ptr outcome;
  try {
    steps(*this);
  } catch (...) {
    outcome = std::current_exception();
  }
  ranHere_.push_back(outcome);
  return ranHere_.size() - 1;
}

void AcrossHostsContext::finishRail(size_t ticket) {
  if (ranHere_.at(ticket)) std::rethrow_exception(ranHere_[ticket]);
}

namespace {

bool overlap(const void* a, size_t aBytes, const void* b, size_t bBytes) {
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  return x < y + bBytes && y < x + aBytes;
}

// Blocks for this host's ranks go through the segment; blocks for the others go directly
// over the network, all at once. Where an output overlaps a block still to be sent (an
// all_to_all in place), the blocks for other hosts are copied aside first: a receive would
// otherwise overwrite them while they are going out.
void allToAllAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  const HostLayout& L = ctx.layout();
  const size_t es = elementSize(args.type);
  const std::vector<int>& here = L.ranksOn[L.host];
  auto isLocal = [&](int q) { return std::find(here.begin(), here.end(), q) != here.end(); };
  std::vector<const void*> sources = args.inputs;
  bool aside = false;
  for (int q = 0; q < L.size && !aside; ++q) {
    if (isLocal(q)) continue;
    for (int o = 0; o < L.size && !aside; ++o) {
      aside = overlap(args.inputs[q], args.inputCounts[q] * es, args.outputs[o],
                      args.outputCounts[o] * es);
    }
  }
  if (aside) {
    for (int q = 0; q < L.size; ++q) {
      if (isLocal(q)) continue;
      uint8_t* copy = ctx.scratch(args.inputCounts[q] * es);
      ctx.copy(copy, args.inputs[q], args.inputCounts[q] * es);
      sources[q] = copy;
    }
  }
  auto local = CollectiveArgs::of(CollectiveKind::kAllToAll, args.type, ReduceOp(), 0, args.count,
                                  nullptr, nullptr);
  local.variable = args.variable;
  for (int q : here) {
    local.inputs.push_back(args.inputs[q]);
    local.inputCounts.push_back(args.inputCounts[q]);
    local.outputs.push_back(args.outputs[q]);
    local.outputCounts.push_back(args.outputCounts[q]);
  }
  ctx.runLocal(local);
  std::vector<NetTransfer> sends, receives;
  for (int q = 0; q < L.size; ++q) {
    if (isLocal(q)) continue;
    sends.push_back({q, const_cast<void*>(sources[q]), args.inputCounts[q] * es, 0});
    receives.push_back({q, args.outputs[q], args.outputCounts[q] * es, 0});
  }
  ctx.exchange(sends, receives);
}

// An all_to_all of equal blocks up to this many bytes per rank goes through carriers: a
// message per host pair and rail instead of one per pair of ranks, so its latency is two
// local steps and one network step whatever the number of ranks. Measured on the 16-core
// host, 8 B to 32 KiB per rank: 31-49 µs against 104-114 µs direct across 2 namespace
// hosts x 4 ranks, 78-100 against 142-312 µs across 4 x 2.
constexpr size_t kCarriedAllToAllBytes = size_t{128} << 10;
// ... and up to this many, each host pair on as few rails as the rails allow (CarrierPlan).
// Beyond it the busiest carrier's bytes count more than its partners: at 128 KiB per rank
// spreading took 1.36x as long on 4 x 2 and 1.12x on 4 x 4 (0.70x on 8 x 2); up to 32 KiB
// it took 0.35-0.84x on 3 x 4, 4 x 2, 4 x 4 and 8 x 2 (docs/PERFORMANCE.md, "Fewer partners
// per carrier").
constexpr size_t kSpreadAllToAllBytes = size_t{32} << 10;

// Which rails carry the traffic between two hosts, and which of a host's ranks each of them
// carries for it. A carrier's exchange costs about one network round per partner host (on
// the 16-core host 58-65 µs with three partners where an exchange with one took 20 µs), so
// small calls spread the partners over the rails rather than every rail meeting every
// partner. The host pairs are coloured as a round-robin tournament's rounds (every host
// meets each colour at most once); colour c goes to the (c mod groups)-th group of m
// consecutive rails, m = R / colours (at least 1); within a pair, rail g m + i carries the
// sources j with j mod m = i on both hosts. Not spread: m = R, every rail meets every host.
class CarrierPlan {
 public:
  CarrierPlan(const HostLayout& L, bool spread) : L_(L) {
    const int H = L.hosts();
    const int colours = H % 2 == 0 ? H - 1 : H;
    perPair_ = spread ? std::max(1, L.rails / colours) : L.rails;
    groups_ = L.rails / perPair_;
  }
  /// The first of the perPair() rails that carry the pair (this host, B).
  int firstRail(int B) const { return (colour(L_.host, B) % groups_) * perPair_; }
  /// True if rail s carries the pair (this host, B).
  bool carries(int s, int B) const { return s >= firstRail(B) && s < firstRail(B) + perPair_; }
  /// The local index of the rank that carries source j's blocks for host B.
  int carrierOf(int j, int B) const { return firstRail(B) + j % perPair_; }
  /// How many of host `host`'s ranks rail s (which carries the pair (this host, B)) carries.
  size_t sourceCount(int host, int s, int B) const {
    const int i = s - firstRail(B);
    const int ranks = static_cast<int>(L_.ranksOn[host].size());
    return static_cast<size_t>((ranks - i + perPair_ - 1) / perPair_);
  }
  /// The i-th of them (a local index on that host).
  int source(int s, int B, size_t i) const {
    return s - firstRail(B) + static_cast<int>(i) * perPair_;
  }

 private:
  // The round of a round-robin tournament in which hosts x and y meet.
  int colour(int x, int y) const {
    const int H = L_.hosts();
    if (H % 2 != 0) return (x + y) % H;
    if (x == H - 1) return (2 * y) % (H - 1);
    if (y == H - 1) return (2 * x) % (H - 1);
    return (x + y) % (H - 1);
  }

  const HostLayout& L_;
  int perPair_ = 1;
  int groups_ = 1;
};

// Small all_to_all of equal blocks through carriers (CarrierPlan): (1) a local all_to_all
// hands every rank here its block from each rank here and each carrier, behind that block,
// the blocks its sources have for the hosts it carries for them; (2) each carrier sends
// each host it carries for one message (its sources' blocks for that host's ranks) to the
// same rail's rank there; (3) a local all_to_all hands each rank the blocks the carriers
// received for it. A carrier's own blocks skip the local steps.
void carriedAllToAll(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  const HostLayout& L = ctx.layout();
  const size_t es = elementSize(args.type);
  const size_t b = args.count * es;  // bytes per block
  const CarrierPlan plan(L, b * static_cast<size_t>(L.size) <= kSpreadAllToAllBytes);
  const int R = L.rails;
  const int me = L.localIndex;
  const int A = L.host;
  const int H = L.hosts();
  const int n = L.localSize();
  const std::vector<int>& here = L.ranksOn[A];
  auto hostSize = [&](int B) { return L.ranksOn[B].size(); };
  // The blocks source j hands local rank t to carry: for every rank of every other host
  // that t carries j's blocks to (none for itself: a carrier reads its own input).
  auto carriedBlocks = [&](int j, int t) {
    size_t blocks = 0;
    if (j == t || t >= R) return blocks;
    for (int B = 0; B < H; ++B) {
      if (B != A && plan.carrierOf(j, B) == t) blocks += hostSize(B);
    }
    return blocks;
  };

  // 1. Within the host: to each rank t, this rank's block for it and, behind that, this
  //    rank's blocks for the ranks of every host t carries for it, in host order.
  CollectiveArgs step1 =
      CollectiveArgs::of(CollectiveKind::kAllToAll, args.type, ReduceOp(), 0, 0, nullptr, nullptr);
  step1.variable = true;
  std::vector<uint8_t*> fromSource(static_cast<size_t>(n), nullptr);  // what j hands this rank
  for (int t = 0; t < n; ++t) {
    const size_t out = b + carriedBlocks(me, t) * b;
    const void* input = args.inputs[here[t]];
    if (out != b) {
      uint8_t* staged = ctx.scratch(out);
      ctx.copy(staged, args.inputs[here[t]], b);
      size_t at = b;
      for (int B = 0; B < H; ++B) {
        if (B == A || plan.carrierOf(me, B) != t) continue;
        for (int q : L.ranksOn[B]) {
          ctx.copy(staged + at, args.inputs[q], b);
          at += b;
        }
      }
      input = staged;
    }
    step1.inputs.push_back(input);
    step1.inputCounts.push_back(out / es);
    const size_t in = b + carriedBlocks(t, me) * b;
    if (in != b) fromSource[t] = ctx.scratch(in);
    step1.outputs.push_back(fromSource[t] ? fromSource[t] : args.outputs[here[t]]);
    step1.outputCounts.push_back(in / es);
  }
  ctx.runLocal(step1);
  for (int t = 0; t < n; ++t) {
    if (fromSource[t]) ctx.copy(args.outputs[here[t]], fromSource[t], b);
  }

  // 2. Carriers: one message to the same rail's rank on every host they carry for.
  std::vector<NetTransfer> sends, receives;
  std::vector<uint8_t*> arrived(static_cast<size_t>(H), nullptr);
  std::vector<size_t> offsets(static_cast<size_t>(n), b);  // the next host's blocks from j
  for (int B = 0; B < H && me < R; ++B) {
    if (B == A || !plan.carries(me, B)) continue;
    const size_t lb = hostSize(B);
    const size_t mine = plan.sourceCount(A, me, B);
    uint8_t* message = ctx.scratch(mine * lb * b);
    for (size_t i = 0; i < mine; ++i) {
      const int j = plan.source(me, B, i);
      uint8_t* to = message + i * lb * b;
      if (j == me) {
        for (size_t x = 0; x < lb; ++x) ctx.copy(to + x * b, args.inputs[L.ranksOn[B][x]], b);
      } else {
        ctx.copy(to, fromSource[j] + offsets[j], lb * b);
        offsets[j] += lb * b;
      }
    }
    sends.push_back({L.ranksOn[B][me], message, mine * lb * b, 0});
    const size_t theirs = plan.sourceCount(B, me, B);
    arrived[B] = ctx.scratch(theirs * static_cast<size_t>(n) * b);
    receives.push_back({L.ranksOn[B][me], arrived[B], theirs * n * b, 0});
  }
  ctx.exchange(sends, receives);

  // 3. Within the host: each carrier hands each rank what came for it, host by host.
  CollectiveArgs step3 =
      CollectiveArgs::of(CollectiveKind::kAllToAll, args.type, ReduceOp(), 0, 0, nullptr, nullptr);
  step3.variable = true;
  // The blocks rail t brings this host from each other host's ranks.
  auto brought = [&](int t) {
    size_t blocks = 0;
    if (t >= R) return blocks;
    for (int B = 0; B < H; ++B) {
      if (B != A && plan.carries(t, B)) blocks += plan.sourceCount(B, t, B);
    }
    return blocks;
  };
  const size_t carried = brought(me);
  std::vector<uint8_t*> fromCarrier(static_cast<size_t>(n), nullptr);
  for (int k = 0; k < n; ++k) {
    const size_t give = k == me ? 0 : carried;
    uint8_t* perRank = give == 0 ? nullptr : ctx.scratch(give * b);
    size_t i = 0;
    for (int B = 0; B < H && perRank; ++B) {
      if (B == A || !plan.carries(me, B)) continue;
      for (size_t x = 0; x < plan.sourceCount(B, me, B); ++x) {
        ctx.copy(perRank + i++ * b, arrived[B] + (x * n + k) * b, b);
      }
    }
    step3.inputs.push_back(perRank ? perRank : args.outputs[here[me]]);
    step3.inputCounts.push_back(give * b / es);
    const size_t take = k == me ? 0 : brought(k);
    if (take != 0) fromCarrier[k] = ctx.scratch(take * b);
    step3.outputs.push_back(fromCarrier[k] ? fromCarrier[k] : args.outputs[here[me]]);
    step3.outputCounts.push_back(take * b / es);
  }
  ctx.runLocal(step3);
  for (int t = 0; t < std::min(n, R); ++t) {
    size_t i = 0;
    for (int B = 0; B < H; ++B) {
      if (B == A || !plan.carries(t, B)) continue;
      for (size_t x = 0; x < plan.sourceCount(B, t, B); ++x) {
        const int source = L.ranksOn[B][plan.source(t, B, x)];
        // What this rank carried in itself comes straight from the message.
        const uint8_t* from = t == me ? arrived[B] + (x * n + me) * b : fromCarrier[t] + i++ * b;
        ctx.copy(args.outputs[source], from, b);
      }
    }
  }
}

// reduce: the all_reduce, kept by the root only.
void reduceAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  const size_t bytes = args.count * elementSize(args.type);
  void* result = ctx.layout().rank == args.root ? args.output : ctx.scratch(bytes);
  allReduceAcrossHosts(ctx, args.input, result, args.count, args.type, args.op);
}

// gather: the all_gather, kept by the root only.
void gatherAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  const HostLayout& L = ctx.layout();
  const size_t bytes = args.count * elementSize(args.type);
  std::vector<void*> outputs = args.outputs;
  if (L.rank != args.root) {
    uint8_t* sink = ctx.scratch(bytes * static_cast<size_t>(L.size));
    outputs.clear();
    for (int q = 0; q < L.size; ++q) outputs.push_back(sink + bytes * static_cast<size_t>(q));
  }
  allGatherAcrossHosts(ctx, args.input, outputs,
                       std::vector<size_t>(static_cast<size_t>(L.size), args.count), args.type, 0);
}

// scatter: the root's blocks broadcast end to end; each rank keeps its own.
void scatterAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  const HostLayout& L = ctx.layout();
  const size_t bytes = args.count * elementSize(args.type);
  uint8_t* all = ctx.scratch(bytes * static_cast<size_t>(L.size));
  if (L.rank == args.root) {
    for (int q = 0; q < L.size; ++q) ctx.copy(all + bytes * q, args.inputs[q], bytes);
  }
  broadcastAcrossHosts(ctx, all, all, args.count * static_cast<size_t>(L.size), args.type,
                       args.root);
  ctx.copy(args.output, all + bytes * static_cast<size_t>(L.rank), bytes);
}

}  // namespace

void runAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  switch (args.kind) {
    case CollectiveKind::kAllReduce:
      return allReduceAcrossHosts(ctx, args.input, args.output, args.count, args.type, args.op);
    case CollectiveKind::kAllGather:
      return allGatherAcrossHosts(ctx, args.input, args.outputs, args.outputCounts, args.type,
                                  args.countsHash);
    case CollectiveKind::kReduceScatter:
      return reduceScatterAcrossHosts(ctx, args.inputs, args.inputCounts, args.output, args.type,
                                      args.op, args.countsHash);
    case CollectiveKind::kBroadcast:
      return broadcastAcrossHosts(ctx, args.input, args.output, args.count, args.type, args.root);
    case CollectiveKind::kAllToAll: {
      const size_t bytes =
          args.count * elementSize(args.type) * static_cast<size_t>(ctx.layout().size);
      if (!args.variable && bytes <= kCarriedAllToAllBytes) return carriedAllToAll(ctx, args);
      return allToAllAcrossHosts(ctx, args);
    }
    case CollectiveKind::kReduce: return reduceAcrossHosts(ctx, args);
    case CollectiveKind::kGather: return gatherAcrossHosts(ctx, args);
    case CollectiveKind::kScatter: return scatterAcrossHosts(ctx, args);
    case CollectiveKind::kBarrier: {
      uint8_t* token = ctx.scratch(1);
      ctx.zero(token, 1);
      return allReduceAcrossHosts(ctx, token, token, 1, DataType::kUInt8,
                                  ReduceOp(ReduceKind::kBitOr));
    }
  }
}

}  // namespace loom
