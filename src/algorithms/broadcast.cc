// broadcast: the root streams its buffer through its slot, chunk by chunk; every other rank
// copies each chunk out. Non-roots post a phase before reading it (they write nothing), which
// tells the root they are done with the phase before: the root may then refill that half,
// so it writes chunk c + 1 while the others still read chunk c.

#include "algorithms/collective.h"

namespace loom {

using Await = CollectiveContext::Await;

void broadcast(CollectiveContext& ctx, const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t perChunk = ctx.chunkBytes() / es;
  const bool root = ctx.rank() == args.root;
  const auto* in = static_cast<const uint8_t*>(args.input);
  auto* out = static_cast<uint8_t*>(args.output);
  const bool stream = ctx.streams(args.count * es);
  for (size_t c = 0, chunks = chunksOf(args.count, perChunk); c < chunks; ++c) {
    const size_t begin = c * perChunk;
    const size_t n = std::min(perChunk, args.count - begin);
    const uint64_t p = ctx.startPhase(root);
    if (root) ctx.copy(ctx.slot(ctx.rank(), p), in + begin * es, n * es);
    ctx.finishPhase(p, root ? Await::kNobody : Await::kRoot);
    if (!root) ctx.copy(out + begin * es, ctx.slot(args.root, p), n * es, stream);
  }
  if (root) ctx.copy(out, in, args.count * es, stream);
}

}  // namespace loom
