// The spread copy's plan: launches, piece offsets and runs.

#include "cuda/spread_plan.h"

#include <algorithm>

namespace loom::cuda {

namespace {

uint64_t alignedUp(uint64_t bytes) {
  return (bytes + 15) / 16 * 16;
}

}  // namespace

std::vector<SpreadLaunch> planSpread(std::span<const Segment> pieces, uint64_t aloneBytes,
                                     int multiprocessors, std::vector<Segment>& alone) {
  std::vector<SpreadLaunch> launches;
  const auto most = static_cast<uint64_t>(8 * std::max(1, multiprocessors));
  SpreadLaunch next{};
  uint64_t total = 0;
  auto close = [&] {
    if (next.params.count == 0) return;
    const uint64_t blocks =
        std::clamp<uint64_t>((total + kMinSpreadRun - 1) / kMinSpreadRun, 1, most);
    next.params.perBlock = alignedUp((total + blocks - 1) / blocks);
    next.blocks = static_cast<unsigned>((total + next.params.perBlock - 1) / next.params.perBlock);
    launches.push_back(next);
    next = SpreadLaunch{};
    total = 0;
  };
  for (const Segment& piece : pieces) {
    if (piece.bytes == 0) continue;
    if (piece.bytes >= aloneBytes) {
      alone.push_back(piece);
      continue;
    }
    if (next.params.count == kMaxSpreadPieces) close();
    next.params.pieces[next.params.count] = piece;
    next.params.starts[next.params.count] = total;
    ++next.params.count;
    total += alignedUp(piece.bytes);  // every piece starts 16-aligned in the whole
  }
  close();
  return launches;
}

}  // namespace loom::cuda
