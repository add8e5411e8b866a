// all_reduce and reduce: one reduction through the slots, two ways, whose result lands on
// every rank (all_reduce) or on the root alone (reduce: the other ranks only contribute and
// never wait for the result).
//
// One-shot (small messages): each rank copies its input into its slot, posts; the ranks that
// receive wait for all, then reduce all slots (in rank order) into their output. One
// synchronisation, but every receiving rank reads every input: size * N bytes per rank.
//
// Two-shot (large messages), per chunk of the input:
//   phase a: copy the chunk in, but for slice `rank`, which only this rank reads; post;
//            wait for all;
//   phase b: reduce slice `rank` of the chunk across the other slots and this rank's input
//            (read where it lies) into this rank's other half;
//            post; the receiving ranks wait for all;
//   then the receiving ranks copy every rank's reduced slice to their output (the gather).
// Each element is reduced by exactly one rank (the root of a reduce does not do it all), so
// reads per rank are about (3 - 1/size)N, and with two halves per rank a fast rank copies
// chunk c + 1 in while others still gather chunk c.

#include "algorithms/collective.h"

namespace loom {

using Await = CollectiveContext::Await;

void reduceOneShot(CollectiveContext& ctx, const CollectiveArgs& args, bool receives) {
  const size_t es = elementSize(args.type);
  const size_t perChunk = ctx.chunkBytes() / es;
  const kernels::ReduceSpec spec{args.type, args.op, ctx.size()};
  const auto* in = static_cast<const uint8_t*>(args.input);
  auto* out = static_cast<uint8_t*>(args.output);
  PerRank<const void*> srcs(static_cast<size_t>(ctx.size()));
  for (size_t c = 0, chunks = chunksOf(args.count, perChunk); c < chunks; ++c) {
    const size_t begin = c * perChunk;
    const size_t n = std::min(perChunk, args.count - begin);
    const uint64_t p = ctx.startPhase(true);
    ctx.copy(ctx.slot(ctx.rank(), p), in + begin * es, n * es);
    ctx.finishPhase(p, receives ? Await::kAll : Await::kNobody);
    if (!receives) continue;
    for (int q = 0; q < ctx.size(); ++q) srcs[q] = ctx.slot(q, p);
    ctx.reduce(out + begin * es, srcs, n, spec);
  }
}

void reduceTwoShot(CollectiveContext& ctx, const CollectiveArgs& args, bool receives) {
  const size_t es = elementSize(args.type);
  const size_t perChunk = ctx.chunkBytes() / es;
  const size_t align = lineElements(args.type);
  const int me = ctx.rank();
  const int size = ctx.size();
  const kernels::ReduceSpec spec{args.type, args.op, size};
  const auto* in = static_cast<const uint8_t*>(args.input);
  auto* out = static_cast<uint8_t*>(args.output);
  PerRank<const void*> srcs(static_cast<size_t>(size));
  PerRank<CopyTask> gatherTasks(static_cast<size_t>(size));
  const bool stream = ctx.streams(args.count * es);
  // The reduction reads this rank's own slice from the input, unless the output straddles
  // it (a partial overlap; in place is fine: each chunk's slice is read before the gather
  // writes it).
  const size_t bytes = args.count * es;
  const bool ownFromInput = !receives || in == out || !rangesOverlap(in, bytes, out, bytes);
  for (size_t c = 0, chunks = chunksOf(args.count, perChunk); c < chunks; ++c) {
    const size_t begin = c * perChunk;
    const size_t n = std::min(perChunk, args.count - begin);
    const auto [lo, hi] = sliceOf(n, me, size, align);
    // Phase a: inputs in (around my own slice, if the reduction reads it in place).
    const uint64_t a = ctx.startPhase(true);
    uint8_t* slot = ctx.slot(me, a);
    const uint8_t* chunk = in + begin * es;
    if (ownFromInput) {
      const CopyTask around[2] = {{slot, chunk, lo * es},
                                  {slot + hi * es, chunk + hi * es, (n - hi) * es}};
      ctx.copy(around);
    } else {
      ctx.copy(slot, chunk, n * es);
    }
    ctx.finishPhase(a, Await::kAll);
    // Phase b: reduce my slice of everyone's chunk into my other half.
    const uint64_t b = ctx.startPhase(true);
    for (int q = 0; q < size; ++q) srcs[q] = ctx.slot(q, a) + lo * es;
    if (ownFromInput) srcs[me] = chunk + lo * es;
    ctx.reduce(ctx.slot(me, b) + lo * es, srcs, hi - lo, spec);
    ctx.finishPhase(b, receives ? Await::kAll : Await::kNobody);
    if (!receives) continue;
    // Gather every rank's reduced slice.
    for (int q = 0; q < size; ++q) {
      const auto [qlo, qhi] = sliceOf(n, q, size, align);
      gatherTasks[q] = {out + (begin + qlo) * es, ctx.slot(q, b) + qlo * es, (qhi - qlo) * es};
    }
    ctx.copy(gatherTasks, stream);
  }
}

}  // namespace loom
