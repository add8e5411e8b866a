// reduce_scatter (equal or per-rank counts): each rank's slot is divided into one region per
// destination. Per chunk, every rank copies the next part of each block into that block's
// region, posts and waits for all; rank r then reduces region r of every slot (in rank
// order) straight into its output.

#include "algorithms/collective.h"

namespace loom {

void reduceScatter(CollectiveContext& ctx, const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t region = regionElements(ctx, args.type);
  const int me = ctx.rank();
  const int size = ctx.size();
  const kernels::ReduceSpec spec{args.type, args.op, size};
  auto* out = static_cast<uint8_t*>(args.output);
  size_t longest = 0;
  for (size_t n : args.inputCounts) longest = std::max(longest, n);
  auto partOf = [&](int q, size_t begin) {
    const size_t n = args.inputCounts[q];
    return begin >= n ? size_t{0} : std::min(region, n - begin);
  };
  std::vector<CopyTask> tasks(static_cast<size_t>(size));
  std::vector<const void*> srcs(static_cast<size_t>(size));
  for (size_t c = 0, chunks = chunksOf(longest, region); c < chunks; ++c) {
    const size_t begin = c * region;
    const uint64_t p = ctx.startPhase(true);
    uint8_t* mine = ctx.slot(me, p);
    for (int q = 0; q < size; ++q) {
      tasks[q] = {mine + q * region * es, static_cast<const uint8_t*>(args.inputs[q]) + begin * es,
                  partOf(q, begin) * es};
    }
    ctx.copy(tasks);
    ctx.finishPhase(p, CollectiveContext::Await::kAll);
    for (int q = 0; q < size; ++q) srcs[q] = ctx.slot(q, p) + me * region * es;
    ctx.reduce(out + begin * es, srcs, partOf(me, begin), spec);
  }
}

}  // namespace loom
