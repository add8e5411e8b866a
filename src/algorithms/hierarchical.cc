// The hierarchical collectives across hosts: local steps around rail steps (hierarchical.h).

#include "algorithms/hierarchical.h"

#include <algorithm>

#include "algorithms/rail.h"

namespace loom {

namespace {

// Below this many bytes a collective uses one rail: fewer local steps beat spreading a few
// kilobytes over several network connections.
constexpr size_t kOneRailBytes = size_t{64} << 10;

int railsFor(const HostLayout& L, size_t bytes) {
  return bytes < kOneRailBytes ? 1 : L.rails;
}

// Rail s: the rank of local index s on every host, in host order.
Rail railOf(const HostLayout& L, int s) {
  Rail rail;
  for (const auto& ranks : L.ranksOn) rail.members.push_back(ranks[static_cast<size_t>(s)]);
  rail.position = L.host;
  return rail;
}

uint8_t* at(void* base, size_t elements, size_t es) {
  return static_cast<uint8_t*>(base) + elements * es;
}
const uint8_t* at(const void* base, size_t elements, size_t es) {
  return static_cast<const uint8_t*>(base) + elements * es;
}

// A V collective among this host's ranks; the caller fills in the per-rank lists. The
// caller's counts hash goes into every local step's descriptor, so local ranks that were
// given different counts fail at the first one.
CollectiveArgs localV(CollectiveKind kind, DataType type, ReduceOp op, uint64_t countsHash) {
  CollectiveArgs a = CollectiveArgs::of(kind, type, op, 0, 0, nullptr, nullptr);
  a.variable = true;
  a.countsHash = countsHash;
  return a;
}

// Element bounds of `parts` slices of `count`, cut at cache lines.
Bounds slices(size_t count, int parts, DataType type) {
  Bounds bounds(static_cast<size_t>(parts) + 1);
  for (int i = 0; i <= parts; ++i) bounds[i] = sliceOf(count, i, parts, lineElements(type)).first;
  return bounds;
}

// Each host's blocks laid end to end in rank order (its range), cut into one piece per rail.
class HostRanges {
 public:
  HostRanges(const HostLayout& L, const std::vector<size_t>& counts, int rails, DataType type)
      : L_(L), counts_(counts), rails_(rails), align_(lineElements(type)) {
    for (const auto& ranks : L.ranksOn) {
      size_t total = 0;
      for (int q : ranks) total += counts[q];
      totals_.push_back(total);
    }
  }

  size_t total(int h) const { return totals_[h]; }
  /// Piece s of host h: [first, second) within its range.
  std::pair<size_t, size_t> piece(int h, int s) const {
    return sliceOf(totals_[h], s, rails_, align_);
  }
  size_t pieceSize(int h, int s) const {
    const auto [b, e] = piece(h, s);
    return e - b;
  }
  /// Rail s's buffer: every host's piece s, in host order.
  Bounds railBounds(int s) const {
    Bounds bounds{0};
    for (int h = 0; h < L_.hosts(); ++h) bounds.push_back(bounds.back() + pieceSize(h, s));
    return bounds;
  }
  /// Calls fn(q, offset in q's block, offset in the range, count) for each block of host
  /// h that overlaps [a, b) of its range.
  template <class Fn>
  void overlaps(int h, size_t a, size_t b, Fn&& fn) const {
    size_t start = 0;
    for (int q : L_.ranksOn[h]) {
      const size_t end = start + counts_[q];
      const size_t lo = std::max(a, start), hi = std::min(b, end);
      if (lo < hi) fn(q, lo - start, lo, hi - lo);
      start = end;
    }
  }

 private:
  const HostLayout& L_;
  const std::vector<size_t>& counts_;
  const int rails_;
  const size_t align_;
  std::vector<size_t> totals_;
};

// Integer AVG: partial sums over a host or a rail would wrap in a narrow type (an int8 sum of
// two ranks can pass 127), so such sums run in int64, and each element is divided and
// narrowed once, as the one-host kernels do.
bool sumsWiden(DataType type, ReduceOp op) {
  return op.kind() == ReduceKind::kAvg && !isFloatingPoint(type) && elementSize(type) < 8;
}

}  // namespace

namespace {

// An all_reduce of at least two segments goes in segments, so that the rail thread's
// all_reduce of one overlaps this thread's local steps on the next and the previous.
constexpr size_t kSegmentBytes = size_t{4} << 20;
constexpr int kMaxSegments = 16;

// Rail jobs a collective has started: every one is finished before the collective returns,
// also when a local step fails (the jobs write into its buffers).
class RailJobs {
 public:
  explicit RailJobs(AcrossHostsContext& ctx) : ctx_(ctx) {}
  ~RailJobs() {
    for (size_t ticket : pending_) {
      try {
        ctx_.finishRail(ticket);
      } catch (...) {
        // The collective is failing already; its error is the one that counts.
      }
    }
  }
  RailJobs(const RailJobs&) = delete;
  RailJobs& operator=(const RailJobs&) = delete;

  size_t start(AcrossHostsContext::RailSteps steps) {
    pending_.push_back(ctx_.startRail(std::move(steps)));
    return pending_.back();
  }
  void finish(size_t ticket) {
    pending_.erase(std::find(pending_.begin(), pending_.end(), ticket));
    ctx_.finishRail(ticket);
  }

 private:
  AcrossHostsContext& ctx_;
  std::vector<size_t> pending_;
};

// One segment of an all_reduce: `count` elements at `input` and `output`.
class AllReduceSegment {
 public:
  AllReduceSegment(const HostLayout& L, const void* input, void* output, size_t count,
                   DataType type, ReduceOp op, uint64_t countsHash)
      : L_(L),
        input_(input),
        output_(output),
        count_(count),
        type_(type),
        op_(op),
        countsHash_(countsHash),
        es_(elementSize(type)),
        rails_(railsFor(L, count * es_)),
        bounds_(slices(count, rails_, type)) {}

  /// Rail rank s gets slice s reduced over this host.
  void reduceWithinHost(AcrossHostsContext& ctx) const {
    const ReduceOp local = op_.kind() == ReduceKind::kAvg ? ReduceOp(ReduceKind::kSum) : op_;
    CollectiveArgs scatter = localV(CollectiveKind::kReduceScatter, type_, local, countsHash_);
    scatter.count = count_;
    for (int j = 0; j < L_.localSize(); ++j) {
      scatter.inputs.push_back(at(input_, start(j), es_));
      scatter.inputCounts.push_back(length(j));
    }
    scatter.output = at(output_, start(L_.localIndex), es_);
    ctx.runLocal(scatter);
  }

  /// This rank's rail all-reduces its slice across hosts (nothing for a rank beyond the
  /// rails). Copies what it needs: it may run on the rail thread after this is gone.
  AcrossHostsContext::RailSteps acrossHosts() const {
    const int me = L_.localIndex;
    if (me >= rails_) return nullptr;
    const ReduceKind kind = op_.kind();
    const ReduceOp rail = kind == ReduceKind::kAvg || kind == ReduceKind::kPremulSum
                              ? ReduceOp(ReduceKind::kSum)
                              : op_;
    return [members = railOf(L_, me), mine = at(output_, bounds_[me], es_), n = length(me),
            type = type_, rail, op = op_, ranks = L_.size](AcrossHostsContext& ctx) {
      railAllReduce(ctx, members, mine, n, type, rail);
      if (op.kind() == ReduceKind::kAvg) {
        const void* src = mine;
        ctx.reduce(mine, {&src, 1}, n, {type, op, ranks});  // divides by every rank
      }
    };
  }

  /// Every rank of the host gathers the slices.
  void gatherWithinHost(AcrossHostsContext& ctx) const {
    CollectiveArgs gather = localV(CollectiveKind::kAllGather, type_, ReduceOp(), countsHash_);
    gather.count = count_;
    gather.input = at(output_, start(L_.localIndex), es_);
    for (int j = 0; j < L_.localSize(); ++j) {
      gather.outputs.push_back(at(output_, start(j), es_));
      gather.outputCounts.push_back(length(j));
    }
    ctx.runLocal(gather);
  }

 private:
  size_t start(int j) const { return j < rails_ ? bounds_[j] : 0; }
  size_t length(int j) const { return j < rails_ ? bounds_[j + 1] - bounds_[j] : 0; }

  const HostLayout& L_;
  const void* input_;
  void* output_;
  size_t count_;
  DataType type_;
  ReduceOp op_;
  uint64_t countsHash_;
  size_t es_;
  int rails_;
  Bounds bounds_;
};

}  // namespace

void allReduceAcrossHosts(AcrossHostsContext& ctx, const void* input, void* output, size_t count,
                          DataType type, ReduceOp op, uint64_t countsHash) {
  if (sumsWiden(type, op)) {
    uint8_t* wide = ctx.scratch(count * sizeof(int64_t));
    ctx.convert(wide, DataType::kInt64, input, type, count);
    allReduceAcrossHosts(ctx, wide, wide, count, DataType::kInt64, op, countsHash);
    ctx.convert(output, type, wide, DataType::kInt64, count);
    return;
  }
  const HostLayout& L = ctx.layout();
  const size_t es = elementSize(type);
  const size_t bytes = count * es;
  const int segments = static_cast<int>(std::clamp<size_t>(bytes / kSegmentBytes, 1, kMaxSegments));
  const Bounds cuts = slices(count, segments, type);
  std::vector<AllReduceSegment> parts;
  for (int s = 0; s < segments; ++s) {
    parts.emplace_back(L, at(input, cuts[s], es), at(output, cuts[s], es), cuts[s + 1] - cuts[s],
                       type, op, countsHash);
  }
  if (segments == 1) {  // nothing to overlap: the rail part runs on this thread
    parts[0].reduceWithinHost(ctx);
    if (auto steps = parts[0].acrossHosts()) steps(ctx);
    parts[0].gatherWithinHost(ctx);
    return;
  }
  // Segment s: reduce within the host, start its rail part, then finish the rail part of
  // segment s - 1 and gather that one within the host.
  RailJobs jobs(ctx);
  std::vector<size_t> tickets(static_cast<size_t>(segments), SIZE_MAX);
  auto gatherPrevious = [&](int s) {
    if (tickets[s] != SIZE_MAX) jobs.finish(tickets[s]);
    parts[s].gatherWithinHost(ctx);
  };
  for (int s = 0; s < segments; ++s) {
    parts[s].reduceWithinHost(ctx);
    if (auto steps = parts[s].acrossHosts()) tickets[s] = jobs.start(std::move(steps));
    if (s > 0) gatherPrevious(s - 1);
  }
  gatherPrevious(segments - 1);
}

void allGatherAcrossHosts(AcrossHostsContext& ctx, const void* input,
                          const std::vector<void*>& outputs, const std::vector<size_t>& counts,
                          DataType type, uint64_t countsHash) {
  const HostLayout& L = ctx.layout();
  const size_t es = elementSize(type);
  const std::vector<int>& here = L.ranksOn[L.host];
  size_t total = 0;
  for (size_t n : counts) total += n;
  const int rails = railsFor(L, total * es);
  const HostRanges ranges(L, counts, rails, type);
  const int me = L.localIndex;

  // 1. Every rank of this host gets the host's blocks.
  CollectiveArgs local = localV(CollectiveKind::kAllGather, type, ReduceOp(), countsHash);
  local.input = input;
  for (int q : here) {
    local.outputs.push_back(outputs[q]);
    local.outputCounts.push_back(counts[q]);
  }
  ctx.runLocal(local);

  // 2. Rail s all-gathers piece s of every host's range.
  std::vector<Bounds> railBounds;
  for (int s = 0; s < rails; ++s) railBounds.push_back(ranges.railBounds(s));
  uint8_t* staged = nullptr;
  if (me < rails) {
    const Bounds& bounds = railBounds[me];
    staged = ctx.scratch(bounds.back() * es);
    const auto [pb, pe] = ranges.piece(L.host, me);
    ranges.overlaps(L.host, pb, pe, [&](int q, size_t inBlock, size_t inRange, size_t n) {
      ctx.copy(at(staged, bounds[L.host] + inRange - pb, es), at(outputs[q], inBlock, es), n * es);
    });
    railAllGather(ctx, railOf(L, me), staged, bounds, type);
  }

  // 3. Every rank of this host gathers what the rails brought, then puts the other hosts'
  //    pieces in place.
  CollectiveArgs spread = localV(CollectiveKind::kAllGather, type, ReduceOp(), countsHash);
  size_t received = 0;
  for (int s = 0; s < rails; ++s) received += railBounds[s].back();
  uint8_t* arrivals = ctx.scratch(received * es);
  std::vector<const uint8_t*> fromRail;
  size_t offset = 0;
  for (int j = 0; j < L.localSize(); ++j) {
    const size_t n = j < rails ? railBounds[j].back() : 0;
    uint8_t* place = j == me && staged ? staged : at(arrivals, offset, es);
    spread.outputs.push_back(place);
    spread.outputCounts.push_back(n);
    if (j < rails) fromRail.push_back(place);
    offset += n;
  }
  spread.input = staged ? staged : arrivals;
  ctx.runLocal(spread);
  for (int s = 0; s < rails; ++s) {
    for (int h = 0; h < L.hosts(); ++h) {
      if (h == L.host) continue;
      const auto [pb, pe] = ranges.piece(h, s);
      ranges.overlaps(h, pb, pe, [&](int q, size_t inBlock, size_t inRange, size_t n) {
        ctx.copy(at(outputs[q], inBlock, es), at(fromRail[s], railBounds[s][h] + inRange - pb, es),
                 n * es);
      });
    }
  }
}

void reduceScatterAcrossHosts(AcrossHostsContext& ctx, const std::vector<const void*>& inputs,
                              const std::vector<size_t>& counts, void* output, DataType type,
                              ReduceOp op, uint64_t countsHash) {
  const HostLayout& L = ctx.layout();
  size_t total = 0;
  for (size_t n : counts) total += n;
  if (sumsWiden(type, op)) {
    uint8_t* wide = ctx.scratch(total * sizeof(int64_t));
    std::vector<const void*> wideInputs;
    size_t offset = 0;
    for (int q = 0; q < L.size; ++q) {
      uint8_t* place = wide + offset * sizeof(int64_t);
      ctx.convert(place, DataType::kInt64, inputs[q], type, counts[q]);
      wideInputs.push_back(place);
      offset += counts[q];
    }
    uint8_t* mine = ctx.scratch(counts[L.rank] * sizeof(int64_t));
    reduceScatterAcrossHosts(ctx, wideInputs, counts, mine, DataType::kInt64, op, countsHash);
    ctx.convert(output, type, mine, DataType::kInt64, counts[L.rank]);
    return;
  }
  const size_t es = elementSize(type);
  const int rails = railsFor(L, total * es);
  const HostRanges ranges(L, counts, rails, type);
  const int me = L.localIndex;
  const ReduceKind kind = op.kind();
  const ReduceOp localOp = kind == ReduceKind::kAvg ? ReduceOp(ReduceKind::kSum) : op;
  const ReduceOp railOp =
      kind == ReduceKind::kAvg || kind == ReduceKind::kPremulSum ? ReduceOp(ReduceKind::kSum) : op;

  // 1. Lay this rank's input out rail by rail (each rail's pieces of every host, in host
  //    order), and reduce-scatter that within the host: rail rank s gets rail s's part.
  std::vector<Bounds> railBounds;
  std::vector<size_t> railStart{0};
  for (int s = 0; s < rails; ++s) {
    railBounds.push_back(ranges.railBounds(s));
    railStart.push_back(railStart.back() + railBounds[s].back());
  }
  uint8_t* laidOut = ctx.scratch(total * es);
  for (int s = 0; s < rails; ++s) {
    for (int h = 0; h < L.hosts(); ++h) {
      const auto [pb, pe] = ranges.piece(h, s);
      ranges.overlaps(h, pb, pe, [&](int q, size_t inBlock, size_t inRange, size_t n) {
        ctx.copy(at(laidOut, railStart[s] + railBounds[s][h] + inRange - pb, es),
                 at(inputs[q], inBlock, es), n * es);
      });
    }
  }
  uint8_t* mine = me < rails ? ctx.scratch(railBounds[me].back() * es) : nullptr;
  CollectiveArgs local = localV(CollectiveKind::kReduceScatter, type, localOp, countsHash);
  for (int j = 0; j < L.localSize(); ++j) {
    local.inputs.push_back(at(laidOut, j < rails ? railStart[j] : 0, es));
    local.inputCounts.push_back(j < rails ? railBounds[j].back() : 0);
  }
  local.output = mine ? mine : laidOut;
  ctx.runLocal(local);

  // 2. Rail s reduce-scatters across hosts: this host's piece s ends complete here.
  if (me < rails) {
    const Bounds& bounds = railBounds[me];
    railReduceScatter(ctx, railOf(L, me), mine, bounds, type, railOp);
    if (kind == ReduceKind::kAvg) {
      uint8_t* piece = at(mine, bounds[L.host], es);
      const void* src = piece;
      ctx.reduce(piece, {&src, 1}, bounds[L.host + 1] - bounds[L.host], {type, op, L.size});
    }
  }

  // 3. The rail ranks hand each rank of the host its block (all-to-all within the host).
  CollectiveArgs handOut = localV(CollectiveKind::kAllToAll, type, ReduceOp(), countsHash);
  const std::vector<int>& here = L.ranksOn[L.host];
  const int localSize = L.localSize();
  handOut.inputs.assign(static_cast<size_t>(localSize), mine ? mine : laidOut);
  handOut.inputCounts.assign(static_cast<size_t>(localSize), 0);
  handOut.outputs.assign(static_cast<size_t>(localSize), output);
  handOut.outputCounts.assign(static_cast<size_t>(localSize), 0);
  auto indexOf = [&](int q) {
    return static_cast<int>(std::find(here.begin(), here.end(), q) - here.begin());
  };
  for (int s = 0; s < rails; ++s) {
    const auto [pb, pe] = ranges.piece(L.host, s);
    ranges.overlaps(L.host, pb, pe, [&](int q, size_t inBlock, size_t inRange, size_t n) {
      const int j = indexOf(q);
      if (s == me) {  // what this rank sends to j
        handOut.inputs[j] = at(mine, railBounds[s][L.host] + inRange - pb, es);
        handOut.inputCounts[j] = n;
      }
      if (j == me) {  // what this rank receives from rail s
        handOut.outputs[s] = at(output, inBlock, es);
        handOut.outputCounts[s] = n;
      }
    });
  }
  ctx.runLocal(handOut);
}

void broadcastAcrossHosts(AcrossHostsContext& ctx, const void* input, void* output, size_t count,
                          DataType type, int root) {
  const HostLayout& L = ctx.layout();
  const size_t es = elementSize(type);
  int rootHost = 0, rootIndex = 0;
  for (int h = 0; h < L.hosts(); ++h) {
    const auto& ranks = L.ranksOn[h];
    const auto it = std::find(ranks.begin(), ranks.end(), root);
    if (it != ranks.end()) {
      rootHost = h;
      rootIndex = static_cast<int>(it - ranks.begin());
    }
  }
  const int rails = railsFor(L, count * es);
  const Bounds bounds = slices(count, rails, type);
  const int me = L.localIndex;
  auto start = [&](int j) { return j < rails ? bounds[j] : 0; };
  auto length = [&](int j) { return j < rails ? bounds[j + 1] - bounds[j] : 0; };

  // 1. The root's host: every rank gets the data.
  if (L.host == rootHost) {
    auto local = CollectiveArgs::of(CollectiveKind::kBroadcast, type, ReduceOp(), rootIndex, count,
                                    input, output);
    ctx.runLocal(local);
  }
  // 2. Rail s carries slice s from the root's host to the others.
  if (me < rails)
    railBroadcast(ctx, railOf(L, me), at(output, bounds[me], es), length(me), type, rootHost);
  // 3. Every other host gathers the slices.
  if (L.host != rootHost) {
    CollectiveArgs gather = localV(CollectiveKind::kAllGather, type, ReduceOp(), 0);
    gather.count = count;
    gather.input = at(output, start(me), es);
    for (int j = 0; j < L.localSize(); ++j) {
      gather.outputs.push_back(at(output, start(j), es));
      gather.outputCounts.push_back(length(j));
    }
    ctx.runLocal(gather);
  }
}

}  // namespace loom
