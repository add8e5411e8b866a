// all_gather (equal or per-rank counts): per chunk, every rank copies the next part of its
// contribution into its slot, posts and waits for all, then copies every rank's part out.

#include "algorithms/collective.h"

namespace loom {

void allGather(CollectiveContext& ctx, const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t perChunk = ctx.chunkBytes() / es;
  const int me = ctx.rank();
  const int size = ctx.size();
  const auto* in = static_cast<const uint8_t*>(args.input);
  size_t longest = 0;
  for (size_t n : args.outputCounts) longest = std::max(longest, n);
  std::vector<CopyTask> tasks;
  tasks.reserve(static_cast<size_t>(size));
  size_t total = 0;
  for (size_t n : args.outputCounts) total += n;
  const bool stream = ctx.streams(total * es);
  auto partOf = [&](int q, size_t begin) {
    const size_t n = args.outputCounts[q];
    return begin >= n ? size_t{0} : std::min(perChunk, n - begin);
  };
  for (size_t c = 0, chunks = chunksOf(longest, perChunk); c < chunks; ++c) {
    const size_t begin = c * perChunk;
    const uint64_t p = ctx.startPhase(true);
    ctx.copy(ctx.slot(me, p), in + begin * es, partOf(me, begin) * es);
    ctx.finishPhase(p, CollectiveContext::Await::kAll);
    tasks.clear();
    for (int q = 0; q < size; ++q) {
      auto* dst = static_cast<uint8_t*>(args.outputs[q]) + begin * es;
      if (q == me && args.outputs[q] == args.input) continue;  // in place
      tasks.push_back({dst, ctx.slot(q, p), partOf(q, begin) * es});
    }
    ctx.copy(tasks, stream);
  }
}

}  // namespace loom
