// all_gather (equal or per-rank counts): per chunk, every rank copies the next part of its
// contribution into its slot, posts and waits for all, then copies every rank's part out.
// When every rank lent its input (Algorithm::kLent), each copies the others' inputs straight
// into its output instead: no slots, no chunks, half the copying.

#include "algorithms/collective.h"

namespace loom {

namespace {

// Copies every rank's lent input (mapped in `inputs`) into its block of the output.
void allGatherLent(CollectiveContext& ctx, const CollectiveArgs& args,
                   const std::vector<const uint8_t*>& inputs) {
  const size_t es = elementSize(args.type);
  std::vector<CopyTask> tasks;
  size_t total = 0;
  for (int q = 0; q < ctx.size(); ++q) {
    total += args.outputCounts[q] * es;
    if (q == ctx.rank() && args.outputs[q] == args.input) continue;  // in place
    tasks.push_back({args.outputs[q], inputs[q], args.outputCounts[q] * es});
  }
  ctx.copy(tasks, ctx.streams(total));
  ctx.closeReads();
}

}  // namespace

void allGather(CollectiveContext& ctx, const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t perChunk = ctx.chunkBytes() / es;
  const int me = ctx.rank();
  const int size = ctx.size();
  const auto* in = static_cast<const uint8_t*>(args.input);
  size_t longest = 0;
  for (size_t n : args.outputCounts) longest = std::max(longest, n);
  PerRank<CopyTask> tasks(static_cast<size_t>(size));
  size_t total = 0;
  for (size_t n : args.outputCounts) total += n;
  const bool stream = ctx.streams(total * es);
  if (ctx.lends()) {
    std::vector<size_t> bytes(static_cast<size_t>(size));
    for (int q = 0; q < size; ++q) bytes[q] = args.outputCounts[q] * es;
    const auto inputs = ctx.openLent(args.input, bytes);
    if (!inputs.empty()) return allGatherLent(ctx, args, inputs);
  }
  auto partOf = [&](int q, size_t begin) {
    const size_t n = args.outputCounts[q];
    return begin >= n ? size_t{0} : std::min(perChunk, n - begin);
  };
  for (size_t c = 0, chunks = chunksOf(longest, perChunk); c < chunks; ++c) {
    const size_t begin = c * perChunk;
    const uint64_t p = ctx.startPhase(true);
    ctx.copy(ctx.slot(me, p), in + begin * es, partOf(me, begin) * es);
    ctx.finishPhase(p, CollectiveContext::Await::kAll);
    size_t used = 0;
    for (int q = 0; q < size; ++q) {
      auto* dst = static_cast<uint8_t*>(args.outputs[q]) + begin * es;
      if (q == me && args.outputs[q] == args.input) continue;  // in place
      tasks[used++] = {dst, ctx.slot(q, p), partOf(q, begin) * es};
    }
    ctx.copy(tasks.first(used), stream);
  }
}

}  // namespace loom
