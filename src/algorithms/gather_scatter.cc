// gather and scatter, the rooted collectives with per-rank blocks.
//
// gather: non-roots stream their input through their slots; the root waits for all each
// chunk and copies every slot out. scatter: the root fills one region per destination in
// its slot each chunk; every other rank copies its region out. In both, the rank that only
// reads posts each phase first, telling the writers it is done with the previous one.

#include "algorithms/collective.h"

namespace loom {

using Await = CollectiveContext::Await;

void gather(CollectiveContext& ctx, const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t perChunk = ctx.chunkBytes() / es;
  const int me = ctx.rank();
  const bool root = me == args.root;
  const auto* in = static_cast<const uint8_t*>(args.input);
  std::vector<CopyTask> tasks;
  const bool stream = ctx.streams(args.count * es * static_cast<size_t>(ctx.size()));
  for (size_t c = 0, chunks = chunksOf(args.count, perChunk); c < chunks; ++c) {
    const size_t begin = c * perChunk;
    const size_t n = std::min(perChunk, args.count - begin);
    const uint64_t p = ctx.startPhase(!root);
    if (!root) ctx.copy(ctx.slot(me, p), in + begin * es, n * es);
    ctx.finishPhase(p, root ? Await::kAll : Await::kNobody);
    if (!root) continue;
    tasks.clear();
    for (int q = 0; q < ctx.size(); ++q) {
      if (q == me) continue;
      tasks.push_back(
          {static_cast<uint8_t*>(args.outputs[q]) + begin * es, ctx.slot(q, p), n * es});
    }
    ctx.copy(tasks, stream);
  }
  if (root) ctx.copy(args.outputs[me], in, args.count * es);
}

void scatter(CollectiveContext& ctx, const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t region = regionElements(ctx, args.type);
  const int me = ctx.rank();
  const bool root = me == args.root;
  auto* out = static_cast<uint8_t*>(args.output);
  std::vector<CopyTask> tasks;
  for (size_t c = 0, chunks = chunksOf(args.count, region); c < chunks; ++c) {
    const size_t begin = c * region;
    const size_t n = std::min(region, args.count - begin);
    const uint64_t p = ctx.startPhase(root);
    if (root) {
      tasks.clear();
      uint8_t* mine = ctx.slot(me, p);
      for (int q = 0; q < ctx.size(); ++q) {
        if (q == me) continue;
        tasks.push_back({mine + q * region * es,
                         static_cast<const uint8_t*>(args.inputs[q]) + begin * es, n * es});
      }
      ctx.copy(tasks);
    }
    ctx.finishPhase(p, root ? Await::kNobody : Await::kRoot);
    if (!root) ctx.copy(out + begin * es, ctx.slot(args.root, p) + me * region * es, n * es);
  }
  if (root) ctx.copy(out, args.inputs[me], args.count * es);
}

}  // namespace loom
