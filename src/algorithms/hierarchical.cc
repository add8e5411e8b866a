// The hierarchical collectives across hosts: local steps around rail steps (hierarchical.h).

#include "algorithms/hierarchical.h"

#include <algorithm>
#include <optional>

#include "algorithms/rail.h"

namespace loom {

namespace {

// Below this many bytes a collective uses one rail: fewer local steps beat spreading a few
// kilobytes over several network connections. (A broadcast there sends whole copies over
// several rails instead, to different hosts: SpreadHosts below.)
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

// Each host's blocks laid end to end in rank order (its range), cut into one piece per rail.
class HostRanges {
 public:
  HostRanges(const HostLayout& L, std::vector<size_t> counts, int rails, DataType type)
      : L_(L), counts_(std::move(counts)), rails_(rails), align_(lineElements(type)) {
    for (const auto& ranks : L.ranksOn) {
      size_t total = 0;
      for (int q : ranks) total += counts_[q];
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
  const std::vector<size_t> counts_;
  const int rails_;
  const size_t align_;
  std::vector<size_t> totals_;
};

// AVG: partial sums over a host or a rail, stored in the element type, can pass its range where
// the average does not: a narrow integer's wrap (an int8 sum of two ranks can pass 127), and
// float16's 65504 (two ranks of 40000 sum to inf, and inf divided stays inf). Such sums run
// in a wide type (int64; float32 for float16), and each element is divided and narrowed once,
// as the one-host kernels do. float16 AVG across hosts so moves twice its bytes between
// hosts; bfloat16 and the wider floats keep their own, whose sums overflow only near the
// type's largest finite value (bfloat16 and float32 sum in float32: two ranks of 3e38 make
// inf, as Gloo's AVG does; NCCL scales each input by 1/P first and keeps 3e38).
std::optional<DataType> sumsWiden(DataType type, ReduceOp op) {
  if (op.kind() != ReduceKind::kAvg) return std::nullopt;
  if (type == DataType::kFloat16) return DataType::kFloat32;
  if (!isFloatingPoint(type) && elementSize(type) < 8) return DataType::kInt64;
  return std::nullopt;
}

ReduceOp withinHost(ReduceOp op) {
  return op.kind() == ReduceKind::kAvg ? ReduceOp(ReduceKind::kSum) : op;
}
ReduceOp betweenHosts(ReduceOp op) {
  const ReduceKind k = op.kind();
  return k == ReduceKind::kAvg || k == ReduceKind::kPremulSum ? ReduceOp(ReduceKind::kSum) : op;
}

// ---- segments and the pipeline ----

// A collective of at least two segments' bytes goes in segments, so that the rail thread's
// network steps for one overlap this thread's local steps on the next and the previous
// (measured: an all_reduce across 2 hosts on 10 Gb/s links went from 61-67% of the link to
// 90-93%). Each segment takes a slice of every rank's block. Segments of 2 MiB rather than
// 4 took 16 MiB all_reduce on 2 x 4 ranks at 10 Gb/s from 76-91% of the links to 95-96%
// (the first segment's local steps and the last one's are what the network cannot hide);
// 1 MiB was no better there (docs/PERFORMANCE.md, "Segments of 2 MiB").
// Broadcast keeps 4 MiB: a rail's chain needs at least 4 (H - 2) pieces of 128 KiB per
// segment (rail.cc), and 2 MiB would send 8 hosts of one rank, or 4 of four, to the scatter
// and all-gather instead, which sends 2 (H - 1) / H of the buffer from every host, not one.
constexpr size_t kSegmentBytes = size_t{2} << 20;
constexpr size_t kBroadcastSegmentBytes = size_t{4} << 20;
constexpr int kMaxSegments = 16;

int segmentsFor(size_t bytes, size_t segmentBytes = kSegmentBytes) {
  return static_cast<int>(std::clamp<size_t>(bytes / segmentBytes, 1, kMaxSegments));
}

// With several lanes, an all_reduce, reduce_scatter or broadcast that the sizes above cut in
// fewer segments than there are lanes goes in up to one segment per lane, each at least
// 1 MiB, so that every lane carries a share. On 2 namespace hosts of one rank, two lanes:
// broadcast of 2 and 4 MiB 0.65x and 0.59x the time of one segment, reduce_scatter of 2 MiB
// 0.73x, all_reduce 0.89x, the other sizes from 1 to 8 MiB within 0.93-1.04x; all_gather of
// 2 MiB took 1.27x, so it keeps its segments (docs/PERFORMANCE.md, "Lanes").
constexpr size_t kLaneSegmentBytes = size_t{1} << 20;
int segmentsOverLanes(const AcrossHostsContext& ctx, size_t bytes, size_t segmentBytes) {
  const int usual = segmentsFor(bytes, segmentBytes);
  if (usual >= ctx.lanes()) return usual;
  return static_cast<int>(std::clamp<size_t>(bytes / kLaneSegmentBytes, 1, ctx.lanes()));
}

// Where every host has one rank and 2 MiB segments would make the rails halve (8 hosts:
// blocks of 256 KiB), an all_reduce, a reduce_scatter and a small enough all_gather go in
// segments of this much per host, so their rails go round a ring of such blocks. Halving's
// partners start each step apart and a late one holds up the next (48 exchanges per 16 MiB
// all_reduce on 8 hosts, each receive ending 150-230 µs after its own send), where a ring
// streams (traced, docs/PERFORMANCE.md "Where 8 x 1's time goes"). 8 x 1 took 0.69-0.76x
// main's time from 4 to 16 MiB for all_reduce (0.62-0.70x through torch), as one segment did
// in two earlier calls, and 0.54-0.95x from 4 to 64 MiB for reduce_scatter (two calls;
// "Lone ranks' rings for all_gather and reduce_scatter"). Not for 3-5 hosts, whose rails
// ring already: there larger segments lost by leaving the copy of the input unoverlapped.
constexpr size_t kLoneRingBlockBytes = size_t{2} << 20;

// The segment size of an all_reduce, all_gather or reduce_scatter across hosts: a property
// of the layout, so every rank cuts the buffer alike.
size_t segmentBytesFor(const HostLayout& L) {
  const int hosts = L.hosts();
  if (L.size != hosts) return kSegmentBytes;
  const bool halves = railPatternFor(hosts, kSegmentBytes / hosts) == RailPattern::kHalving;
  const bool rings = railPatternFor(hosts, kLoneRingBlockBytes) == RailPattern::kRing;
  return halves && rings ? hosts * kLoneRingBlockBytes : kSegmentBytes;
}

// One segment of a hierarchical collective: local steps before the network, the rail part
// (on the rail thread when there are several segments), local steps after. Every rank of a
// host runs the same local steps in the same order.
class Segment {
 public:
  virtual ~Segment() = default;
  virtual void before(AcrossHostsContext& ctx) = 0;
  /// This rank's network steps, or null (a rank beyond the rails, a host with nothing to
  /// send). They may run on the rail thread, while this thread runs later segments' `before`
  /// and earlier segments' `after`: each segment's memory is its own.
  virtual AcrossHostsContext::RailSteps acrossHosts() = 0;
  virtual void after(AcrossHostsContext& ctx) = 0;
};

using Segments = std::vector<std::unique_ptr<Segment>>;

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

  size_t start(AcrossHostsContext::RailSteps steps, int lane) {
    pending_.push_back(ctx_.startRail(std::move(steps), lane));
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

// How many segments' rail parts a pipeline has started and not finished, at most: one per
// lane running, and one more waiting on its lane while this thread runs local steps.
size_t inFlight(const AcrossHostsContext& ctx) {
  return static_cast<size_t>(ctx.lanes()) + 1;
}

// Segment s: `before`, then its rail part is started on lane s mod lanes; then segment
// s - lanes's rail part is finished and its `after` runs. With one lane, segment s's network
// steps overlap segment s - 1's local steps; with more, segments' network steps also run
// side by side, each lane over its own connections. A single segment runs on this thread
// alone (a hand-off to a rail thread would only add its latency).
void pipeline(AcrossHostsContext& ctx, Segments& parts) {
  if (parts.size() == 1) {
    parts[0]->before(ctx);
    if (auto steps = parts[0]->acrossHosts()) steps(ctx);
    parts[0]->after(ctx);
    return;
  }
  RailJobs jobs(ctx);
  const size_t lanes = static_cast<size_t>(ctx.lanes());
  std::vector<size_t> tickets(parts.size(), SIZE_MAX);
  auto complete = [&](size_t s) {
    if (tickets[s] != SIZE_MAX) jobs.finish(tickets[s]);
    parts[s]->after(ctx);
  };
  for (size_t s = 0; s < parts.size(); ++s) {
    parts[s]->before(ctx);
    if (auto steps = parts[s]->acrossHosts()) {
      tickets[s] = jobs.start(std::move(steps), static_cast<int>(s % lanes));
    }
    if (s >= lanes) complete(s - lanes);
  }
  for (size_t s = parts.size() > lanes ? parts.size() - lanes : 0; s < parts.size(); ++s) {
    complete(s);
  }
}

// Slice s of `segments` of each block: its start and count per rank.
struct BlockSlices {
  std::vector<size_t> starts, counts;
};
BlockSlices sliceBlocks(const std::vector<size_t>& counts, int s, int segments, DataType type) {
  BlockSlices out;
  for (size_t n : counts) {
    const auto [b, e] = sliceOf(n, s, segments, lineElements(type));
    out.starts.push_back(b);
    out.counts.push_back(e - b);
  }
  return out;
}

// A buffer of `count` elements cut into one slice per rail (at cache lines); the ranks
// beyond the rails hold none. All_reduce and broadcast carry slice s on rail s.
class RailSlices {
 public:
  RailSlices(const HostLayout& L, size_t count, DataType type)
      : L_(L),
        count_(count),
        type_(type),
        rails_(railsFor(L, count * elementSize(type))),
        bounds_(evenBounds(count, rails_, type)) {}

  int rails() const { return rails_; }
  size_t start(int j) const { return j < rails_ ? bounds_[j] : 0; }
  size_t length(int j) const { return j < rails_ ? bounds_[j + 1] - bounds_[j] : 0; }

  /// Every rank of the host gathers the slices of `buffer` (each rail rank's in place).
  void gatherWithinHost(AcrossHostsContext& ctx, void* buffer, uint64_t countsHash) const {
    const size_t es = elementSize(type_);
    CollectiveArgs gather = localV(CollectiveKind::kAllGather, type_, ReduceOp(), countsHash);
    gather.count = count_;
    gather.input = at(buffer, start(L_.localIndex), es);
    for (int j = 0; j < L_.localSize(); ++j) {
      gather.outputs.push_back(at(buffer, start(j), es));
      gather.outputCounts.push_back(length(j));
    }
    ctx.runLocal(gather);
  }

 private:
  const HostLayout& L_;
  const size_t count_;
  const DataType type_;
  const int rails_;
  const Bounds bounds_;
};

// ---- all_reduce ----

// With `pairIncoming` (a rank alone on one of two hosts, so its host's one rail rank; see
// allReduceAcrossHosts) the rail only exchanges the segment and this thread reduces it in
// after(), while the rail goes on to the next segment's exchange.
class AllReduceSegment final : public Segment {
 public:
  AllReduceSegment(const HostLayout& L, const void* input, void* output, size_t count,
                   DataType type, ReduceOp op, uint64_t countsHash, uint8_t* pairIncoming)
      : L_(L),
        input_(input),
        output_(output),
        count_(count),
        type_(type),
        op_(op),
        countsHash_(countsHash),
        es_(elementSize(type)),
        slices_(L, count, type),
        pairIncoming_(pairIncoming) {}

  // Rail rank s gets slice s reduced over this host.
  void before(AcrossHostsContext& ctx) override {
    CollectiveArgs scatter =
        localV(CollectiveKind::kReduceScatter, type_, withinHost(op_), countsHash_);
    scatter.count = count_;
    for (int j = 0; j < L_.localSize(); ++j) {
      scatter.inputs.push_back(at(input_, slices_.start(j), es_));
      scatter.inputCounts.push_back(slices_.length(j));
    }
    scatter.output = at(output_, slices_.start(L_.localIndex), es_);
    ctx.runLocal(scatter);
  }

  // This rank's rail all-reduces its slice across hosts.
  AcrossHostsContext::RailSteps acrossHosts() override {
    if (L_.localIndex >= slices_.rails()) return nullptr;
    return [this](AcrossHostsContext& ctx) {
      const int me = L_.localIndex;
      if (pairIncoming_ != nullptr) {
        return pairAllReduceExchange(ctx, railOf(L_, me), at(output_, slices_.start(me), es_),
                                     pairIncoming_, slices_.length(me) * es_);
      }
      reduceAcrossHosts(ctx, [&](uint8_t* mine, size_t n) {
        railAllReduce(ctx, railOf(L_, me), mine, n, type_, betweenHosts(op_));
      });
    };
  }

  // Every rank of the host gathers the slices (with `pairIncoming`, after reducing the rail's
  // exchange).
  void after(AcrossHostsContext& ctx) override {
    if (pairIncoming_ != nullptr) {
      reduceAcrossHosts(ctx, [&](uint8_t* mine, size_t n) {
        pairAllReduceFinish(ctx, railOf(L_, L_.localIndex), mine, pairIncoming_, n, type_,
                            betweenHosts(op_));
      });
    }
    slices_.gatherWithinHost(ctx, output_, countsHash_);
  }

 private:
  const HostLayout& L_;
  const void* input_;
  void* output_;
  const size_t count_;
  const DataType type_;
  const ReduceOp op_;
  const uint64_t countsHash_;
  const size_t es_;
  const RailSlices slices_;
  uint8_t* const pairIncoming_;  // where the other host's slice arrives, or null

  // This rank's slice reduced across hosts by `reduce(mine, count)`, then divided by every
  // rank for AVG.
  template <class Reduce>
  void reduceAcrossHosts(AcrossHostsContext& ctx, Reduce&& reduce) {
    uint8_t* mine = at(output_, slices_.start(L_.localIndex), es_);
    const size_t n = slices_.length(L_.localIndex);
    reduce(mine, n);
    if (op_.kind() == ReduceKind::kAvg) {
      const void* src = mine;
      ctx.reduce(mine, {&src, 1}, n, {type_, op_, L_.size});  // divides by every rank
    }
  }
};

// ---- all_gather ----

class AllGatherSegment final : public Segment {
 public:
  AllGatherSegment(const HostLayout& L, const void* input, std::vector<void*> outputs,
                   std::vector<size_t> counts, DataType type, uint64_t countsHash, int rails)
      : L_(L),
        input_(input),
        outputs_(std::move(outputs)),
        counts_(counts),
        type_(type),
        countsHash_(countsHash),
        es_(elementSize(type)),
        rails_(rails),
        ranges_(L, std::move(counts), rails, type) {
    for (int s = 0; s < rails_; ++s) railBounds_.push_back(ranges_.railBounds(s));
    gathersInPlace_ = outputsAreTheRailBuffer();
  }

  // Every rank of this host gets the host's blocks; a rail rank stages its piece of them.
  void before(AcrossHostsContext& ctx) override {
    CollectiveArgs local = localV(CollectiveKind::kAllGather, type_, ReduceOp(), countsHash_);
    local.input = input_;
    for (int q : L_.ranksOn[L_.host]) {
      local.outputs.push_back(outputs_[q]);
      local.outputCounts.push_back(counts_[q]);
    }
    ctx.runLocal(local);
    if (gathersInPlace_) {
      staged_ = static_cast<uint8_t*>(outputs_[L_.ranksOn[0][0]]);
      return;
    }
    const int me = L_.localIndex;
    if (me >= rails_) return;
    const Bounds& bounds = railBounds_[me];
    staged_ = ctx.scratch(bounds.back() * es_);
    const auto [pb, pe] = ranges_.piece(L_.host, me);
    ranges_.overlaps(L_.host, pb, pe, [&](int q, size_t inBlock, size_t inRange, size_t n) {
      ctx.copy(at(staged_, bounds[L_.host] + inRange - pb, es_), at(outputs_[q], inBlock, es_),
               n * es_);
    });
  }

  // Rail s all-gathers piece s of every host's range.
  AcrossHostsContext::RailSteps acrossHosts() override {
    if (L_.localIndex >= rails_) return nullptr;
    return [this](AcrossHostsContext& ctx) {
      railAllGather(ctx, railOf(L_, L_.localIndex), staged_, railBounds_[L_.localIndex], type_);
    };
  }

  // Every rank of this host gathers what the rails brought, then puts the other hosts'
  // pieces in place.
  void after(AcrossHostsContext& ctx) override {
    if (gathersInPlace_) return;  // the rail brought them there
    const int me = L_.localIndex;
    CollectiveArgs spread = localV(CollectiveKind::kAllGather, type_, ReduceOp(), countsHash_);
    size_t received = 0;
    for (int s = 0; s < rails_; ++s) received += railBounds_[s].back();
    uint8_t* arrivals = ctx.scratch(received * es_);
    std::vector<const uint8_t*> fromRail;
    size_t offset = 0;
    for (int j = 0; j < L_.localSize(); ++j) {
      const size_t n = j < rails_ ? railBounds_[j].back() : 0;
      uint8_t* place = j == me && staged_ ? staged_ : at(arrivals, offset, es_);
      spread.outputs.push_back(place);
      spread.outputCounts.push_back(n);
      if (j < rails_) fromRail.push_back(place);
      offset += n;
    }
    spread.input = staged_ ? staged_ : arrivals;
    ctx.runLocal(spread);
    for (int s = 0; s < rails_; ++s) {
      for (int h = 0; h < L_.hosts(); ++h) {
        if (h == L_.host) continue;
        const auto [pb, pe] = ranges_.piece(h, s);
        ranges_.overlaps(h, pb, pe, [&](int q, size_t inBlock, size_t inRange, size_t n) {
          ctx.copy(at(outputs_[q], inBlock, es_),
                   at(fromRail[s], railBounds_[s][h] + inRange - pb, es_), n * es_);
        });
      }
    }
  }

 private:
  const HostLayout& L_;
  const void* input_;
  const std::vector<void*> outputs_;
  const std::vector<size_t> counts_;
  const DataType type_;
  const uint64_t countsHash_;
  const size_t es_;
  const int rails_;
  const HostRanges ranges_;
  std::vector<Bounds> railBounds_;
  uint8_t* staged_ = nullptr;  // this rail's pieces of every host (rail ranks)
  bool gathersInPlace_ = false;

  // Where every host has one rank and the outputs lie back to back in host order (one
  // segment of an all_gather into one tensor), they are laid out as the rail's buffer
  // already: the rail gathers straight into them, where staging copied the rank's own block
  // in and every other block out afterwards (unoverlapped in a single segment: 3.5-6.6 ms of
  // a 16 MiB call on 8 x 1, traced; docs/PERFORMANCE.md "Gathered in place").
  bool outputsAreTheRailBuffer() const {
    if (L_.size != L_.hosts() || rails_ != 1) return false;
    const Bounds& bounds = railBounds_[0];
    const auto* base = static_cast<const uint8_t*>(outputs_[L_.ranksOn[0][0]]);
    for (int h = 0; h < L_.hosts(); ++h) {
      const int q = L_.ranksOn[h][0];
      if (outputs_[q] != at(base, bounds[h], es_) || bounds[h + 1] - bounds[h] != counts_[q]) {
        return false;
      }
    }
    return true;
  }
};

// ---- reduce_scatter ----

class ReduceScatterSegment final : public Segment {
 public:
  ReduceScatterSegment(const HostLayout& L, std::vector<const void*> inputs,
                       std::vector<size_t> counts, void* output, DataType type, ReduceOp op,
                       uint64_t countsHash, int rails)
      : L_(L),
        inputs_(std::move(inputs)),
        output_(output),
        type_(type),
        op_(op),
        countsHash_(countsHash),
        es_(elementSize(type)),
        rails_(rails),
        ranges_(L, std::move(counts), rails, type) {
    railStart_.push_back(0);
    for (int s = 0; s < rails_; ++s) {
      railBounds_.push_back(ranges_.railBounds(s));
      railStart_.push_back(railStart_.back() + railBounds_[s].back());
    }
  }

  // This rank's input laid out rail by rail (each rail's pieces of every host, in host
  // order), reduce-scattered within the host: rail rank s gets rail s's part.
  void before(AcrossHostsContext& ctx) override {
    uint8_t* laidOut = ctx.scratch(railStart_.back() * es_);
    for (int s = 0; s < rails_; ++s) {
      for (int h = 0; h < L_.hosts(); ++h) {
        const auto [pb, pe] = ranges_.piece(h, s);
        ranges_.overlaps(h, pb, pe, [&](int q, size_t inBlock, size_t inRange, size_t n) {
          ctx.copy(at(laidOut, railStart_[s] + railBounds_[s][h] + inRange - pb, es_),
                   at(inputs_[q], inBlock, es_), n * es_);
        });
      }
    }
    const int me = L_.localIndex;
    mine_ = me < rails_ ? ctx.scratch(railBounds_[me].back() * es_) : nullptr;
    CollectiveArgs local =
        localV(CollectiveKind::kReduceScatter, type_, withinHost(op_), countsHash_);
    for (int j = 0; j < L_.localSize(); ++j) {
      local.inputs.push_back(at(laidOut, j < rails_ ? railStart_[j] : 0, es_));
      local.inputCounts.push_back(j < rails_ ? railBounds_[j].back() : 0);
    }
    local.output = mine_ ? mine_ : laidOut;
    ctx.runLocal(local);
  }

  // Rail s reduce-scatters across hosts: this host's piece s ends complete here.
  AcrossHostsContext::RailSteps acrossHosts() override {
    if (L_.localIndex >= rails_) return nullptr;
    return [this](AcrossHostsContext& ctx) {
      const Bounds& bounds = railBounds_[L_.localIndex];
      railReduceScatter(ctx, railOf(L_, L_.localIndex), mine_, bounds, type_, betweenHosts(op_));
      if (op_.kind() == ReduceKind::kAvg) {
        uint8_t* piece = at(mine_, bounds[L_.host], es_);
        const void* src = piece;
        ctx.reduce(piece, {&src, 1}, bounds[L_.host + 1] - bounds[L_.host], {type_, op_, L_.size});
      }
    };
  }

  // The rail ranks hand each rank of the host its block (all-to-all within the host).
  void after(AcrossHostsContext& ctx) override {
    const int me = L_.localIndex;
    const std::vector<int>& here = L_.ranksOn[L_.host];
    const auto localSize = static_cast<size_t>(L_.localSize());
    CollectiveArgs handOut = localV(CollectiveKind::kAllToAll, type_, ReduceOp(), countsHash_);
    handOut.inputs.assign(localSize, mine_ ? mine_ : output_);
    handOut.inputCounts.assign(localSize, 0);
    handOut.outputs.assign(localSize, output_);
    handOut.outputCounts.assign(localSize, 0);
    auto indexOf = [&](int q) {
      return static_cast<int>(std::find(here.begin(), here.end(), q) - here.begin());
    };
    for (int s = 0; s < rails_; ++s) {
      const auto [pb, pe] = ranges_.piece(L_.host, s);
      ranges_.overlaps(L_.host, pb, pe, [&](int q, size_t inBlock, size_t inRange, size_t n) {
        const int j = indexOf(q);
        if (s == me) {  // what this rank sends to j
          handOut.inputs[j] = at(mine_, railBounds_[s][L_.host] + inRange - pb, es_);
          handOut.inputCounts[j] = n;
        }
        if (j == me) {  // what this rank receives from rail s
          handOut.outputs[s] = at(output_, inBlock, es_);
          handOut.outputCounts[s] = n;
        }
      });
    }
    ctx.runLocal(handOut);
  }

 private:
  const HostLayout& L_;
  const std::vector<const void*> inputs_;
  void* output_;
  const DataType type_;
  const ReduceOp op_;
  const uint64_t countsHash_;
  const size_t es_;
  const int rails_;
  const HostRanges ranges_;
  std::vector<Bounds> railBounds_;
  std::vector<size_t> railStart_;
  uint8_t* mine_ = nullptr;  // rail s's part, reduced (rail ranks)
};

// ---- broadcast ----

// A broadcast that one rail would carry (under kOneRailBytes) goes to the other hosts over
// several rails instead, each rail taking the whole buffer to its own group of hosts: rail
// j's rank on the root's host is the root of a binomial tree over group j's hosts, which
// receive on their rank of local index j. The groups are the other hosts in order from the
// root's, cut into min(rails, H - 1) runs as even as can be, the longer first, and the
// root's own rail takes the last (shortest) one, or none. So the root's host sends from
// several ranks at once where the root rank sent one round after another, the root itself
// least, and the rounds shrink from ceil(log2 H) to ceil(log2(g + 1)) for the largest
// group's g hosts (4 hosts of 2 ranks: the root sends once, not twice; 4 of 4: one round,
// not two). Through torch the root's call took 0.58-0.65x the time on 4 x 2 up to 32 KiB,
// 0.61-0.79x on 4 x 4 (docs/PERFORMANCE.md, "A small broadcast over every rail").
class SpreadHosts {
 public:
  SpreadHosts(const HostLayout& L, int rootHost, int rootIndex)
      : L_(L),
        rootHost_(rootHost),
        rootIndex_(rootIndex),
        groups_(std::min(L.rails, L.hosts() - 1)) {}

  /// The rails that carry the buffer: local indices 0 .. groups() - 1.
  int groups() const { return groups_; }
  /// The rail (local index) on which host h, not the root's, receives.
  int railOfHost(int h) const {
    const int order = (h - rootHost_ + L_.hosts()) % L_.hosts() - 1;  // 0 .. H - 2
    const int others = L_.hosts() - 1;
    const int base = others / groups_, longer = others % groups_;  // groups of base + 1 first
    const int inLonger = longer * (base + 1);
    const int group = order < inLonger ? order / (base + 1) : longer + (order - inLonger) / base;
    return (rootIndex_ + 1 + group) % groups_;
  }
  /// Rail j over the root's host and the hosts that receive on it, the root's host first.
  Rail railOf(int j) const {
    Rail rail;
    rail.members.push_back(L_.ranksOn[rootHost_][static_cast<size_t>(j)]);
    for (int k = 1; k < L_.hosts(); ++k) {
      const int h = (rootHost_ + k) % L_.hosts();
      if (railOfHost(h) != j) continue;
      if (h == L_.host) rail.position = rail.size();
      rail.members.push_back(L_.ranksOn[h][static_cast<size_t>(j)]);
    }
    return rail;
  }

 private:
  const HostLayout& L_;
  const int rootHost_;
  const int rootIndex_;
  const int groups_;
};

class BroadcastSegment final : public Segment {
 public:
  BroadcastSegment(const HostLayout& L, const void* input, void* output, size_t count,
                   DataType type, int rootHost, int rootIndex)
      : L_(L),
        input_(input),
        output_(output),
        count_(count),
        type_(type),
        rootHost_(rootHost),
        rootIndex_(rootIndex),
        es_(elementSize(type)),
        slices_(L, count, type),
        spread_(L.rails >= 2 && L.hosts() >= 3 && slices_.rails() == 1
                    ? std::optional<SpreadHosts>(std::in_place, L, rootHost, rootIndex)
                    : std::nullopt) {}

  // The root's host: every rank gets the data.
  void before(AcrossHostsContext& ctx) override {
    if (L_.host != rootHost_) return;
    ctx.runLocal(CollectiveArgs::of(CollectiveKind::kBroadcast, type_, ReduceOp(), rootIndex_,
                                    count_, input_, output_));
  }

  // Rail s carries slice s from the root's host to the others; or, spread, rail j the whole
  // buffer to group j.
  AcrossHostsContext::RailSteps acrossHosts() override {
    if (spread_) {
      const int j = L_.localIndex;
      if (j >= spread_->groups() || (L_.host != rootHost_ && spread_->railOfHost(L_.host) != j)) {
        return nullptr;
      }
      return [this, j](AcrossHostsContext& ctx) {
        railBroadcast(ctx, spread_->railOf(j), static_cast<uint8_t*>(output_), count_, type_, 0);
      };
    }
    if (L_.localIndex >= slices_.rails()) return nullptr;
    return [this](AcrossHostsContext& ctx) {
      const int me = L_.localIndex;
      railBroadcast(ctx, railOf(L_, me), at(output_, slices_.start(me), es_), slices_.length(me),
                    type_, rootHost_);
    };
  }

  // Every other host gathers the slices, or, spread, broadcasts from the rank that received.
  void after(AcrossHostsContext& ctx) override {
    if (L_.host == rootHost_) return;
    if (spread_) {
      ctx.runLocal(CollectiveArgs::of(CollectiveKind::kBroadcast, type_, ReduceOp(),
                                      spread_->railOfHost(L_.host), count_, output_, output_));
      return;
    }
    slices_.gatherWithinHost(ctx, output_, 0);
  }

 private:
  const HostLayout& L_;
  const void* input_;
  void* output_;
  const size_t count_;
  const DataType type_;
  const int rootHost_;
  const int rootIndex_;
  const size_t es_;
  const RailSlices slices_;
  const std::optional<SpreadHosts> spread_;
};

}  // namespace

void allReduceAcrossHosts(AcrossHostsContext& ctx, const void* input, void* output, size_t count,
                          DataType type, ReduceOp op, uint64_t countsHash) {
  if (const std::optional<DataType> wideType = sumsWiden(type, op)) {
    uint8_t* wide = ctx.scratch(count * elementSize(*wideType));
    ctx.convert(wide, *wideType, input, type, count);
    allReduceAcrossHosts(ctx, wide, wide, count, *wideType, op, countsHash);
    ctx.convert(output, type, wide, *wideType, count);
    return;
  }
  const size_t es = elementSize(type);
  const int segments = segmentsOverLanes(ctx, count * es, segmentBytesFor(ctx.layout()));
  const Bounds cuts = evenBounds(count, segments, type);
  // Between two hosts a rail's all_reduce is one exchange and one reduction. Done by the rail
  // thread, the reduction keeps the network idle until the next segment's exchange, while a
  // rank alone on its host (no local steps) waits for the rail with nothing else to do; so
  // such a rank's own thread reduces, in the segment's after(). Where a host has several
  // ranks their threads have local steps to run, and handing them the reduction as well was
  // no faster on 2 x 2 and slower on 2 x 4 (docs/PERFORMANCE.md, "The reduction off the rail
  // between two hosts"). Segment s exchanges into buffer s mod inFlight(ctx): a segment's
  // buffer is reduced before the rail job of the segment that reuses it starts (pipeline()).
  const HostLayout& L = ctx.layout();
  std::vector<uint8_t*> pairIncoming(inFlight(ctx), nullptr);
  if (segments > 1 && L.hosts() == 2 && L.localSize() == 1) {
    size_t largest = 0;  // alone on its host, the rank's rail carries each segment whole
    for (int s = 0; s < segments; ++s) largest = std::max(largest, cuts[s + 1] - cuts[s]);
    for (uint8_t*& buffer : pairIncoming) buffer = ctx.scratch(largest * es);
  }
  Segments parts;
  for (int s = 0; s < segments; ++s) {
    parts.push_back(std::make_unique<AllReduceSegment>(
        L, at(input, cuts[s], es), at(output, cuts[s], es), cuts[s + 1] - cuts[s], type, op,
        countsHash, pairIncoming[static_cast<size_t>(s) % pairIncoming.size()]));
  }
  pipeline(ctx, parts);
}

void allGatherAcrossHosts(AcrossHostsContext& ctx, const void* input,
                          const std::vector<void*>& outputs, const std::vector<size_t>& counts,
                          DataType type, uint64_t countsHash) {
  const HostLayout& L = ctx.layout();
  const size_t es = elementSize(type);
  size_t total = 0;
  for (size_t n : counts) total += n;
  const int rails = railsFor(L, total * es);
  // One rank per host: a ring of 2 MiB blocks while the buffer is one such segment (8 x 1:
  // 0.72-0.91x the time of doubling 256 KiB blocks from 4 to 16 MiB); beyond, 2 MiB
  // segments, up to 16 in flight, were faster (the ring's 1.03-1.16x at 32-64 MiB, two calls).
  const size_t ringSegment = segmentBytesFor(L);
  const int segments =
      segmentsFor(total * es, total * es <= ringSegment ? ringSegment : kSegmentBytes);
  Segments parts;
  for (int s = 0; s < segments; ++s) {
    BlockSlices slice = sliceBlocks(counts, s, segments, type);
    std::vector<void*> placed;
    for (int q = 0; q < L.size; ++q) placed.push_back(at(outputs[q], slice.starts[q], es));
    parts.push_back(std::make_unique<AllGatherSegment>(L, at(input, slice.starts[L.rank], es),
                                                       std::move(placed), std::move(slice.counts),
                                                       type, countsHash, rails));
  }
  pipeline(ctx, parts);
}

void reduceScatterAcrossHosts(AcrossHostsContext& ctx, const std::vector<const void*>& inputs,
                              const std::vector<size_t>& counts, void* output, DataType type,
                              ReduceOp op, uint64_t countsHash) {
  const HostLayout& L = ctx.layout();
  size_t total = 0;
  for (size_t n : counts) total += n;
  if (const std::optional<DataType> wideType = sumsWiden(type, op)) {
    const size_t wes = elementSize(*wideType);
    uint8_t* wide = ctx.scratch(total * wes);
    std::vector<const void*> wideInputs;
    size_t offset = 0;
    for (int q = 0; q < L.size; ++q) {
      uint8_t* place = wide + offset * wes;
      ctx.convert(place, *wideType, inputs[q], type, counts[q]);
      wideInputs.push_back(place);
      offset += counts[q];
    }
    uint8_t* mine = ctx.scratch(counts[L.rank] * wes);
    reduceScatterAcrossHosts(ctx, wideInputs, counts, mine, *wideType, op, countsHash);
    ctx.convert(output, type, mine, *wideType, counts[L.rank]);
    return;
  }
  const size_t es = elementSize(type);
  const int rails = railsFor(L, total * es);
  const int segments = segmentsOverLanes(ctx, total * es, segmentBytesFor(L));
  Segments parts;
  for (int s = 0; s < segments; ++s) {
    BlockSlices slice = sliceBlocks(counts, s, segments, type);
    std::vector<const void*> placed;
    for (int q = 0; q < L.size; ++q) placed.push_back(at(inputs[q], slice.starts[q], es));
    parts.push_back(std::make_unique<ReduceScatterSegment>(
        L, std::move(placed), std::move(slice.counts), at(output, slice.starts[L.rank], es), type,
        op, countsHash, rails));
  }
  pipeline(ctx, parts);
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
  const int segments = segmentsOverLanes(ctx, count * es, kBroadcastSegmentBytes);
  const Bounds cuts = evenBounds(count, segments, type);
  Segments parts;
  for (int s = 0; s < segments; ++s) {
    // Only the root passes an input.
    const void* from = L.rank == root ? at(input, cuts[s], es) : nullptr;
    parts.push_back(std::make_unique<BroadcastSegment>(
        L, from, at(output, cuts[s], es), cuts[s + 1] - cuts[s], type, rootHost, rootIndex));
  }
  pipeline(ctx, parts);
}

}  // namespace loom
