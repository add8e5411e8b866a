// Inter-host steps among a rail: ring and recursive halving/doubling reduce-scatters and
// all-gathers, the recursive-doubling all_reduce, and broadcasts (binomial tree, pipelined
// chain, or scatter then all-gather).

#include "algorithms/rail.h"

#include <algorithm>

namespace loom {

namespace {

// An all_reduce of at most this many bytes per member runs as recursive doubling: log2 n
// exchanges of the whole buffer beat 2(n - 1) or 2 log2 n smaller ones while latency rules.
constexpr size_t kDoublingBytes = size_t{64} << 10;
// A broadcast of at most this many bytes goes down a binomial tree in whole; larger ones go
// down a chain in pieces where there are enough pieces to fill it, else are scattered and
// then all-gathered, so no member sends the whole buffer more than once. The tree takes
// log2 n rounds of the whole buffer, the scatter and all-gather 2 log2 n rounds and about
// 2 (n - 1) / n of it, so the tree is faster below about 4 α B bytes on 4 members and 2.4 α B
// on 8 (α: one round's cost, B: a link's rate); 60 KB to 2 MB for 5-20 µs and 3-25 GB/s.
// Measured (docs/PERFORMANCE.md, "One rank per host beyond two hosts"): on namespace hosts
// with open links the tree took 0.28-0.36x the time at 128-256 KiB on 8 hosts of one rank,
// 0.56-0.72x on 4, and 0.40-0.77x on 4 hosts of two ranks (128-256 KiB per rail); on links
// shaped to 10 Gb/s, 1.2-1.3x (4 x 1, 128-256 KiB). 256 KiB sits inside the model's range.
constexpr size_t kTreeBytes = size_t{256} << 10;
// From blocks of this many bytes a rail of 4 or 8 members goes round a ring rather than
// halving and doubling: every member then talks to the same two members for the whole
// pattern, where halving's partners change at every step and each step waits for the
// slowest pair (measured, docs/PERFORMANCE.md "Ring or halving across 4 hosts": 4 hosts x 2
// ranks on 1 Gb/s links, all_reduce 92-94% of the link against 82-87%, all_gather 93-94%
// against 69-79%; unshaped on 2 cores, halving's fewer steps won the all_reduce up to blocks
// of 128 KiB, and by a little at 512 KiB).
constexpr size_t kRingBlockBytes = size_t{512} << 10;
// A broadcast down a chain goes in pieces of this many bytes, at most kMaxChainPieces. On
// 1 Gb/s links (2-core machine) the chain carried 0.112-0.121 GB/s per host from 2-4 MiB
// where the scatter and all-gather carried 0.057-0.065 over 4 hosts and 0.082-0.091 over 3
// (docs/PERFORMANCE.md, "A chain for broadcast across hosts").
constexpr size_t kChainPieceBytes = size_t{128} << 10;
constexpr size_t kMaxChainPieces = 32;
// Where pieces of kChainPieceBytes are too few to fill the chain, it goes in just enough
// smaller pieces, of at least this many bytes. On the 16-core host's namespace links, 4-8
// lone hosts and 4 x 2 took 0.56-0.95x the time of the scatter and all-gather from 512 KiB to
// 2 MiB with pieces of 21-87 KiB, open links and 10 Gb/s ones alike (docs/PERFORMANCE.md,
// "Smaller pieces fill a chain"); 16 KiB pieces and 32 KiB ones did alike where both fill.
constexpr size_t kMinChainPieceBytes = size_t{16} << 10;

// The pieces whose n - 2 piece times of filling cost at most a fifth of a chain's time.
size_t chainFill(int members) {
  return 4 * static_cast<size_t>(members - 2);
}

// The pieces a chain broadcast of `bytes` over `members` goes in: of kChainPieceBytes, at most
// kMaxChainPieces; or, where those do not fill the chain, the fill in smaller pieces, if they
// keep kMinChainPieceBytes and the fill is at most kMaxChainPieces (a longer rail fills in
// more piece times than halving's log2 n rounds cost).
int chainPieces(size_t bytes, int members) {
  const size_t whole = std::min(bytes / kChainPieceBytes, kMaxChainPieces);
  const size_t fill = chainFill(members);
  if (whole >= fill || fill > kMaxChainPieces || bytes / fill < kMinChainPieceBytes) {
    return static_cast<int>(whole);
  }
  return static_cast<int>(fill);
}

// Tags name the step of a pattern in mismatch messages; both ends of a pair compute them.
enum Tag : int {
  kFold = 1000,  // + 0..2: folding a pair in and out
  kRing = 2000,
  kHalving = 3000,
  kDoubling = 4000,
  kTree = 5000,
  kScatter = 6000,
  kChain = 7000,  // + the piece
};

int mod(int a, int n) {
  return ((a % n) + n) % n;
}

bool isPowerOfTwo(int n) {
  return n > 0 && (n & (n - 1)) == 0;
}

// The largest block's elements: every member computes the same bounds, so they agree on it.
size_t largestBlock(const Bounds& bounds) {
  size_t largest = 0;
  for (size_t b = 0; b + 1 < bounds.size(); ++b)
    largest = std::max(largest, bounds[b + 1] - bounds[b]);
  return largest;
}

// Blocks [first, last) of a buffer as one transfer.
NetTransfer blocks(int peer, uint8_t* data, const Bounds& bounds, int first, int last, size_t es,
                   int tag) {
  return {peer, data + bounds[first] * es, (bounds[last] - bounds[first]) * es, tag};
}

void sendOnly(AcrossHostsContext& ctx, const NetTransfer& send) {
  ctx.exchange({&send, 1}, {});
}
void receiveOnly(AcrossHostsContext& ctx, const NetTransfer& receive) {
  ctx.exchange({}, {&receive, 1});
}
void sendReceive(AcrossHostsContext& ctx, const NetTransfer& send, const NetTransfer& receive) {
  ctx.exchange({&send, 1}, {&receive, 1});
}

// Recursive halving/doubling over n members: the largest power of two p <= n runs the
// pattern; the first 2r (r = n - p) pair up, and in each pair the even member folds into
// the odd one, which plays "virtual member" pos / 2 and covers both members' blocks.
struct Fold {
  Fold(int n, int position) : n(n), pos(position) {
    p = 1;
    while (p * 2 <= n) p *= 2;
    r = n - p;
  }
  bool out() const { return pos < 2 * r && pos % 2 == 0; }
  bool absorbs() const { return pos < 2 * r && pos % 2 == 1; }
  int virt() const { return pos < 2 * r ? pos / 2 : pos - r; }
  // The position that plays virtual member v.
  int active(int v) const { return v < r ? 2 * v + 1 : v + r; }
  // The first position whose block virtual member v covers (first(p) = n).
  int first(int v) const { return v < r ? 2 * v : v + r; }

  int n, pos, p, r;
};

// ---- ring ----

// The ring's steps, appended to `steps`. Reduce-scatter step s: send block pos - s - 1 to
// the next member, receive block pos - s - 2 from the previous one into `incoming` and
// reduce it into ours; after n - 1 steps block pos is complete here. All-gather step s:
// send block pos - s, receive block pos - s - 1 in place. Each step sends the block the
// step before produced, and the all-gather's first step sends the block the reduce-scatter
// completed, so an all_reduce is one ring of 2(n - 1) steps (AcrossHostsContext::ring).
void ringReduceScatterSteps(std::vector<RingStep>& steps, const Rail& rail, uint8_t* data,
                            const Bounds& bounds, size_t es, uint8_t* incoming) {
  const int n = rail.size();
  const int pos = rail.position;
  const int next = rail.members[mod(pos + 1, n)];
  const int prev = rail.members[mod(pos - 1, n)];
  for (int step = 0; step < n - 1; ++step) {
    const int out = mod(pos - step - 1, n);
    const int in = mod(pos - step - 2, n);
    const NetTransfer mine = blocks(prev, data, bounds, in, in + 1, es, kRing + step);
    steps.push_back({blocks(next, data, bounds, out, out + 1, es, kRing + step),
                     {prev, incoming, mine.bytes, kRing + step},
                     mine.data});
  }
}

void ringAllGatherSteps(std::vector<RingStep>& steps, const Rail& rail, uint8_t* data,
                        const Bounds& bounds, size_t es) {
  const int n = rail.size();
  const int pos = rail.position;
  const int next = rail.members[mod(pos + 1, n)];
  const int prev = rail.members[mod(pos - 1, n)];
  for (int step = 0; step < n - 1; ++step) {
    const int out = mod(pos - step, n);
    const int in = mod(pos - step - 1, n);
    steps.push_back({blocks(next, data, bounds, out, out + 1, es, kRing + n + step),
                     blocks(prev, data, bounds, in, in + 1, es, kRing + n + step)});
  }
}

void ringReduceScatter(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data,
                       const Bounds& bounds, DataType type, ReduceOp op) {
  const size_t es = elementSize(type);
  std::vector<RingStep> steps;
  ringReduceScatterSteps(steps, rail, data, bounds, es, ctx.scratch(largestBlock(bounds) * es));
  ctx.ring(steps, {type, op, 1});
}

void ringAllGather(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data, const Bounds& bounds,
                   DataType type) {
  std::vector<RingStep> steps;
  ringAllGatherSteps(steps, rail, data, bounds, elementSize(type));
  ctx.ring(steps, {type, ReduceKind::kSum, 1});  // no step reduces
}

// ---- recursive halving and doubling ----

void halvingReduceScatter(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data,
                          const Bounds& bounds, DataType type, ReduceOp op) {
  const int n = rail.size();
  const Fold f(n, rail.position);
  const size_t es = elementSize(type);
  const size_t total = bounds[n] - bounds[0];
  const kernels::ReduceSpec spec{type, op, 1};
  if (f.out()) {
    const int partner = rail.members[f.pos + 1];
    sendOnly(ctx, blocks(partner, data, bounds, 0, n, es, kFold));
    receiveOnly(ctx, blocks(partner, data, bounds, f.pos, f.pos + 1, es, kFold + 1));
    return;
  }
  uint8_t* incoming = ctx.scratch(total * es);
  uint8_t* base = data + bounds[0] * es;
  if (f.absorbs()) {
    receiveOnly(ctx, {rail.members[f.pos - 1], incoming, total * es, kFold});
    const void* srcs[2] = {incoming, base};  // the lower position's operand first
    ctx.reduce(base, srcs, total, spec);
  }
  const int v = f.virt();
  int lo = 0, hi = f.p;
  for (int mask = f.p / 2, step = 0; mask >= 1; mask /= 2, ++step) {
    const int partner = v ^ mask;
    const int mid = lo + mask;
    const auto [keepLo, keepHi] = v < mid ? std::pair{lo, mid} : std::pair{mid, hi};
    const auto [giveLo, giveHi] = v < mid ? std::pair{mid, hi} : std::pair{lo, mid};
    const int peer = rail.members[f.active(partner)];
    const size_t kb = bounds[f.first(keepLo)], ke = bounds[f.first(keepHi)];
    sendReceive(ctx,
                blocks(peer, data, bounds, f.first(giveLo), f.first(giveHi), es, kHalving + step),
                {peer, incoming, (ke - kb) * es, kHalving + step});
    uint8_t* mine = data + kb * es;
    const void* lower[2] = {mine, incoming};
    const void* upper[2] = {incoming, mine};
    ctx.reduce(mine, v < partner ? lower : upper, ke - kb, spec);
    lo = keepLo;
    hi = keepHi;
  }
  if (f.absorbs()) {
    sendOnly(ctx, blocks(rail.members[f.pos - 1], data, bounds, f.pos - 1, f.pos, es, kFold + 1));
  }
}

void doublingAllGather(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data,
                       const Bounds& bounds, DataType type) {
  const int n = rail.size();
  const Fold f(n, rail.position);
  const size_t es = elementSize(type);
  if (f.out()) {
    const int partner = rail.members[f.pos + 1];
    sendOnly(ctx, blocks(partner, data, bounds, f.pos, f.pos + 1, es, kFold));
    const NetTransfer rest[2] = {blocks(partner, data, bounds, 0, f.pos, es, kFold + 1),
                                 blocks(partner, data, bounds, f.pos + 1, n, es, kFold + 2)};
    ctx.exchange({}, rest);
    return;
  }
  if (f.absorbs()) {
    receiveOnly(ctx, blocks(rail.members[f.pos - 1], data, bounds, f.pos - 1, f.pos, es, kFold));
  }
  const int v = f.virt();
  int lo = v, hi = v + 1;
  for (int mask = 1, step = 0; mask < f.p; mask *= 2, ++step) {
    const int partner = v ^ mask;
    const auto [theirLo, theirHi] =
        v < partner ? std::pair{hi, hi + mask} : std::pair{lo - mask, lo};
    const int peer = rail.members[f.active(partner)];
    sendReceive(
        ctx, blocks(peer, data, bounds, f.first(lo), f.first(hi), es, kHalving + 100 + step),
        blocks(peer, data, bounds, f.first(theirLo), f.first(theirHi), es, kHalving + 100 + step));
    lo = std::min(lo, theirLo);
    hi = std::max(hi, theirHi);
  }
  if (f.absorbs()) {
    const int partner = rail.members[f.pos - 1];
    const NetTransfer rest[2] = {blocks(partner, data, bounds, 0, f.pos - 1, es, kFold + 1),
                                 blocks(partner, data, bounds, f.pos, n, es, kFold + 2)};
    ctx.exchange(rest, {});
  }
}

// Recursive doubling: log2 p exchanges of the whole buffer; both partners of a step reduce
// the same two operands in the same order, so they stay bit-identical.
void doublingAllReduce(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data, size_t count,
                       DataType type, ReduceOp op) {
  const Fold f(rail.size(), rail.position);
  const size_t bytes = count * elementSize(type);
  const kernels::ReduceSpec spec{type, op, 1};
  if (f.out()) {
    const int partner = rail.members[f.pos + 1];
    sendOnly(ctx, {partner, data, bytes, kFold});
    receiveOnly(ctx, {partner, data, bytes, kFold + 1});
    return;
  }
  uint8_t* incoming = ctx.scratch(bytes);
  if (f.absorbs()) {
    receiveOnly(ctx, {rail.members[f.pos - 1], incoming, bytes, kFold});
    const void* srcs[2] = {incoming, data};
    ctx.reduce(data, srcs, count, spec);
  }
  const int v = f.virt();
  for (int mask = 1, step = 0; mask < f.p; mask *= 2, ++step) {
    const int partner = v ^ mask;
    const int peer = rail.members[f.active(partner)];
    sendReceive(ctx, {peer, data, bytes, kDoubling + step},
                {peer, incoming, bytes, kDoubling + step});
    const void* lower[2] = {data, incoming};
    const void* upper[2] = {incoming, data};
    ctx.reduce(data, v < partner ? lower : upper, count, spec);
  }
  if (f.absorbs()) sendOnly(ctx, {rail.members[f.pos - 1], data, bytes, kFold + 1});
}

// ---- broadcast ----

// Binomial tree from position 0: in round k, the members that have the data (relative
// positions below 2^k) send it to the member 2^k further on.
void treeBroadcast(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data, size_t bytes) {
  const int n = rail.size();
  const int rel = rail.position;
  for (int mask = 1, step = 0; mask < n; mask *= 2, ++step) {
    if (rel < mask && rel + mask < n) {
      sendOnly(ctx, {rail.members[rel + mask], data, bytes, kTree + step});
    } else if (rel >= mask && rel < 2 * mask) {
      receiveOnly(ctx, {rail.members[rel - mask], data, bytes, kTree + step});
    }
  }
}

// A pipelined chain from position 0: piece k travels down the rail a member per step, each
// member passing piece k - 1 on while it takes piece k, so every link carries the buffer
// once (a scatter then an all-gather makes the root's carry it 2(n - 1)/n times), and m
// pieces arrive after m + n - 2 piece times.
void chainBroadcast(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data, size_t bytes,
                    int pieces) {
  const int n = rail.size();
  const int pos = rail.position;
  const int prev = pos > 0 ? rail.members[pos - 1] : -1;
  const int next = pos + 1 < n ? rail.members[pos + 1] : -1;
  auto piece = [&](int peer, int k) -> NetTransfer {
    const auto [from, to] = sliceOf(bytes, k, pieces, 1);
    return {peer, data + from, to - from, kChain + k};
  };
  // Step k takes piece k (not the root) and passes piece k - 1 on (not the last member).
  for (int k = 0; k <= pieces; ++k) {
    const bool receives = prev >= 0 && k < pieces;
    const bool sends = next >= 0 && k > 0;
    if (receives && sends) {
      // A pipeline step: sent beside the receiving even for pieces below the network
      // context's bar for that (on one thread a piece's socket write and read add up: 0.61-0.87x
      // the time on 3 and 4 hosts of one rank, docs/PERFORMANCE.md "A chain that forwards").
      ctx.forward(piece(next, k - 1), piece(prev, k));
    } else if (receives) {
      receiveOnly(ctx, piece(prev, k));
    } else if (sends) {
      sendOnly(ctx, piece(next, k - 1));
    }
  }
}

// Binomial scatter from position 0: member i ends with block i (and position 0 with all).
void treeScatter(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data, const Bounds& bounds,
                 size_t es) {
  const int n = rail.size();
  const int rel = rail.position;
  int top = 1;
  while (top < n) top *= 2;
  for (int mask = top / 2, step = 0; mask >= 1; mask /= 2, ++step) {
    if (rel % (2 * mask) == 0 && rel + mask < n) {
      const int to = rel + mask;
      sendOnly(ctx, blocks(rail.members[to], data, bounds, to, std::min(to + mask, n), es,
                           kScatter + step));
    } else if (rel % (2 * mask) == mask) {
      receiveOnly(ctx, blocks(rail.members[rel - mask], data, bounds, rel, std::min(rel + mask, n),
                              es, kScatter + step));
    }
  }
}

}  // namespace

Rail Rail::rotated(int first) const {
  Rail r;
  const int n = size();
  for (int i = 0; i < n; ++i) r.members.push_back(members[mod(first + i, n)]);
  r.position = mod(position - first, n);
  return r;
}

RailPattern railPatternFor(int members, size_t blockBytes) {
  if (members <= 3) return RailPattern::kRing;
  if (members >= 16) return RailPattern::kHalving;
  if (isPowerOfTwo(members) && blockBytes < kRingBlockBytes) return RailPattern::kHalving;
  return RailPattern::kRing;
}

void railReduceScatter(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data,
                       const Bounds& bounds, DataType type, ReduceOp op) {
  if (rail.size() == 1) return;
  if (railPatternFor(rail.size(), largestBlock(bounds) * elementSize(type)) == RailPattern::kRing) {
    ringReduceScatter(ctx, rail, data, bounds, type, op);
  } else {
    halvingReduceScatter(ctx, rail, data, bounds, type, op);
  }
}

void railAllGather(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data, const Bounds& bounds,
                   DataType type) {
  if (rail.size() == 1) return;
  if (railPatternFor(rail.size(), largestBlock(bounds) * elementSize(type)) == RailPattern::kRing) {
    ringAllGather(ctx, rail, data, bounds, type);
  } else {
    doublingAllGather(ctx, rail, data, bounds, type);
  }
}

void pairAllReduceExchange(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data,
                           uint8_t* incoming, size_t bytes) {
  if (bytes == 0) return;  // as railAllReduce: nothing to send, no message
  const int peer = rail.members[1 - rail.position];
  sendReceive(ctx, {peer, data, bytes, kDoubling}, {peer, incoming, bytes, kDoubling});
}

void pairAllReduceFinish(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data,
                         const uint8_t* incoming, size_t count, DataType type, ReduceOp op) {
  const void* lower[2] = {data, incoming};
  const void* upper[2] = {incoming, data};
  ctx.reduce(data, rail.position == 0 ? lower : upper, count, {type, op, 1});
}

void railAllReduce(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data, size_t count,
                   DataType type, ReduceOp op) {
  const int n = rail.size();
  if (n == 1 || count == 0) return;
  // Two members: one exchange of the whole buffer moves what a reduce-scatter and an
  // all-gather would, in one step instead of two (recursive doubling's one step).
  if (n == 2) {
    uint8_t* incoming = ctx.scratch(count * elementSize(type));
    pairAllReduceExchange(ctx, rail, data, incoming, count * elementSize(type));
    return pairAllReduceFinish(ctx, rail, data, incoming, count, type, op);
  }
  if (count * elementSize(type) <= kDoublingBytes) {
    return doublingAllReduce(ctx, rail, data, count, type, op);
  }
  const Bounds bounds = evenBounds(count, n, type);
  if (railPatternFor(n, largestBlock(bounds) * elementSize(type)) == RailPattern::kRing) {
    const size_t es = elementSize(type);
    std::vector<RingStep> steps;
    ringReduceScatterSteps(steps, rail, data, bounds, es, ctx.scratch(largestBlock(bounds) * es));
    ringAllGatherSteps(steps, rail, data, bounds, es);
    return ctx.ring(steps, {type, op, 1});
  }
  railReduceScatter(ctx, rail, data, bounds, type, op);
  railAllGather(ctx, rail, data, bounds, type);
}

Bounds evenBounds(size_t count, int parts, DataType type) {
  Bounds bounds(static_cast<size_t>(parts) + 1);
  for (int i = 0; i <= parts; ++i) bounds[i] = sliceOf(count, i, parts, lineElements(type)).first;
  return bounds;
}

BroadcastPattern broadcastPatternFor(int members, size_t bytes) {
  if (members <= 2 || bytes <= kTreeBytes) return BroadcastPattern::kTree;
  return static_cast<size_t>(chainPieces(bytes, members)) >= chainFill(members)
             ? BroadcastPattern::kChain
             : BroadcastPattern::kScatterAllGather;
}

void railBroadcast(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data, size_t count,
                   DataType type, int root) {
  const int n = rail.size();
  if (n == 1 || count == 0) return;
  const Rail fromRoot = rail.rotated(root);
  const size_t es = elementSize(type);
  const size_t bytes = count * es;
  switch (broadcastPatternFor(n, bytes)) {
    case BroadcastPattern::kTree: return treeBroadcast(ctx, fromRoot, data, bytes);
    case BroadcastPattern::kChain:
      return chainBroadcast(ctx, fromRoot, data, bytes, chainPieces(bytes, n));
    case BroadcastPattern::kScatterAllGather: break;
  }
  const Bounds bounds = evenBounds(count, n, type);
  treeScatter(ctx, fromRoot, data, bounds, es);
  railAllGather(ctx, fromRoot, data, bounds, type);
}

}  // namespace loom
