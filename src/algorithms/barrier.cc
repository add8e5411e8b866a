// barrier: the opening phase alone (post, wait for all, check that all ranks called it).

#include "algorithms/collective.h"

namespace loom {

void barrier(CollectiveContext& ctx, const CollectiveArgs& args) {
  const uint64_t p = ctx.nextPhase();
  ctx.open(p, args, Algorithm{});
  ctx.post(p);
  ctx.verifyAll(p);
}

}  // namespace loom
