// barrier: the opening phase alone (post, wait for all, check that all ranks called it).

#include "algorithms/collective.h"

namespace loom {

void barrier(CollectiveContext& ctx, const CollectiveArgs&) {
  ctx.finishPhase(ctx.startPhase(true), CollectiveContext::Await::kAll);
}

}  // namespace loom
