// reduce_scatter (equal or per-rank counts): each rank's slot is divided into one region per
// destination. Per chunk, every rank copies the next part of each block into that block's
// region, posts and waits for all; rank r then reduces region r of every slot (in rank
// order) straight into its output. When every rank lent its input (Algorithm::kLent, blocks
// laid end to end), rank r reduces block r of every rank's input, read in place, instead.

#include "algorithms/collective.h"

namespace loom {

namespace {

// The start of block 0 if the blocks lie end to end (one buffer), else nullptr.
const void* wholeInput(const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const auto* first = static_cast<const uint8_t*>(args.inputs[0]);
  size_t offset = 0;
  for (size_t q = 0; q < args.inputs.size(); ++q) {
    if (args.inputs[q] != first + offset) return nullptr;
    offset += args.inputCounts[q] * es;
  }
  return first;
}

}  // namespace

void reduceScatter(CollectiveContext& ctx, const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t region = regionElements(ctx, args.type);
  const int me = ctx.rank();
  const int size = ctx.size();
  // Past the streaming size, this rank's output is written without reading each line
  // first (kernels/copy.h says why).
  const kernels::ReduceSpec spec{args.type, args.op, size, ctx.streams(args.inputCounts[me] * es)};
  auto* out = static_cast<uint8_t*>(args.output);
  PerRank<const void*> srcs(static_cast<size_t>(size));
  if (ctx.lends()) {
    size_t whole = 0, mine = 0;
    for (int q = 0; q < size; ++q) {
      if (q == me) mine = whole;
      whole += args.inputCounts[q] * es;
    }
    const std::vector<size_t> bytes(static_cast<size_t>(size), whole);
    const auto inputs = ctx.openLent(wholeInput(args), bytes);
    if (!inputs.empty()) {
      for (int q = 0; q < size; ++q) srcs[q] = inputs[q] + mine;
      // In place, the output is this rank's own input block, a source: the kernel then
      // stores plainly (streaming lines just read was 30% slower, P = 2).
      ctx.reduce(out, srcs, args.inputCounts[me], spec);
      return ctx.closeReads();
    }
  }
  size_t longest = 0;
  for (size_t n : args.inputCounts) longest = std::max(longest, n);
  auto partOf = [&](int q, size_t begin) {
    const size_t n = args.inputCounts[q];
    return begin >= n ? size_t{0} : std::min(region, n - begin);
  };
  // Only this rank reads its own block, so the reduction takes it from the input rather
  // than from a copy in the slot (1/size less copying), unless the output partly overlaps
  // it: the kernel allows a destination that is a source, not one that straddles it.
  const auto* own = static_cast<const uint8_t*>(args.inputs[me]);
  const size_t ownBytes = args.inputCounts[me] * es;
  const bool ownFromInput = own == out || !rangesOverlap(own, ownBytes, out, ownBytes);
  PerRank<CopyTask> tasks(static_cast<size_t>(size));
  for (size_t c = 0, chunks = chunksOf(longest, region); c < chunks; ++c) {
    const size_t begin = c * region;
    const uint64_t p = ctx.startPhase(true);
    uint8_t* mine = ctx.slot(me, p);
    for (int q = 0; q < size; ++q) {
      const size_t bytes = q == me && ownFromInput ? 0 : partOf(q, begin) * es;
      tasks[q] = {mine + q * region * es, static_cast<const uint8_t*>(args.inputs[q]) + begin * es,
                  bytes};
    }
    ctx.copy(tasks);
    ctx.finishPhase(p, CollectiveContext::Await::kAll);
    for (int q = 0; q < size; ++q) srcs[q] = ctx.slot(q, p) + me * region * es;
    if (ownFromInput) srcs[me] = own + begin * es;
    ctx.reduce(out + begin * es, srcs, partOf(me, begin), spec);
  }
}

}  // namespace loom
