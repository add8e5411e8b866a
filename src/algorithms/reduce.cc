// reduce to a root: all_reduce's two algorithms, with only the root producing output.
//
// One-shot: every rank copies in and posts; the root waits for all and reduces every slot.
// Two-shot: the same reduce-scatter as all_reduce's (every rank reduces one slice, so the
// reduction work is spread), then only the root gathers the reduced slices.

#include "algorithms/collective.h"

namespace loom {

using Await = CollectiveContext::Await;

void reduceOneShot(CollectiveContext& ctx, const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t perChunk = ctx.chunkBytes() / es;
  const bool root = ctx.rank() == args.root;
  const kernels::ReduceSpec spec{args.type, args.op, ctx.size()};
  const auto* in = static_cast<const uint8_t*>(args.input);
  auto* out = static_cast<uint8_t*>(args.output);
  std::vector<const void*> srcs(static_cast<size_t>(ctx.size()));
  for (size_t c = 0, chunks = chunksOf(args.count, perChunk); c < chunks; ++c) {
    const size_t begin = c * perChunk;
    const size_t n = std::min(perChunk, args.count - begin);
    const uint64_t p = ctx.startPhase(true);
    ctx.copy(ctx.slot(ctx.rank(), p), in + begin * es, n * es);
    ctx.finishPhase(p, root ? Await::kAll : Await::kNobody);
    if (!root) continue;
    for (int q = 0; q < ctx.size(); ++q) srcs[q] = ctx.slot(q, p);
    ctx.reduce(out + begin * es, srcs, n, spec);
  }
}

void reduceTwoShot(CollectiveContext& ctx, const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t perChunk = ctx.chunkBytes() / es;
  const size_t align = lineElements(args.type);
  const int me = ctx.rank();
  const int size = ctx.size();
  const bool root = me == args.root;
  const kernels::ReduceSpec spec{args.type, args.op, size};
  const auto* in = static_cast<const uint8_t*>(args.input);
  auto* out = static_cast<uint8_t*>(args.output);
  std::vector<const void*> srcs(static_cast<size_t>(size));
  std::vector<CopyTask> gatherTasks(static_cast<size_t>(size));
  const bool stream = ctx.streams(args.count * es);
  for (size_t c = 0, chunks = chunksOf(args.count, perChunk); c < chunks; ++c) {
    const size_t begin = c * perChunk;
    const size_t n = std::min(perChunk, args.count - begin);
    const uint64_t a = ctx.startPhase(true);
    ctx.copy(ctx.slot(me, a), in + begin * es, n * es);
    ctx.finishPhase(a, Await::kAll);
    const auto [lo, hi] = sliceOf(n, me, size, align);
    const uint64_t b = ctx.startPhase(true);
    for (int q = 0; q < size; ++q) srcs[q] = ctx.slot(q, a) + lo * es;
    ctx.reduce(ctx.slot(me, b) + lo * es, srcs, hi - lo, spec);
    ctx.finishPhase(b, root ? Await::kAll : Await::kNobody);
    if (!root) continue;
    for (int q = 0; q < size; ++q) {
      const auto [qlo, qhi] = sliceOf(n, q, size, align);
      gatherTasks[q] = {out + (begin + qlo) * es, ctx.slot(q, b) + qlo * es, (qhi - qlo) * es};
    }
    ctx.copy(gatherTasks, stream);
  }
}

}  // namespace loom
