#pragma once

// How the spread copy cuts its pieces into launches and runs (plain C++: tested on machines
// without a GPU; src/cuda/spread_copy launches what it plans).

#include <cstdint>
#include <span>
#include <vector>

#include "cuda/kernel_params.h"

namespace loom::cuda {

/// Fewest bytes one block of the spread copy takes: below this, more blocks cost more to
/// launch than they spread.
inline constexpr uint64_t kMinSpreadRun = uint64_t{64} << 10;

/// One launch of loom_copy_spread: its parameters and its number of blocks.
struct SpreadLaunch {
  SpreadParams params;
  unsigned blocks;
};

/// The launches that copy `pieces`: pieces of `aloneBytes` or more are left out and appended
/// to `alone` (the driver copies them), empty ones are dropped, the rest go in launches of at
/// most kMaxSpreadPieces pieces, each starting 16-byte aligned in its launch's whole, whose
/// bytes are cut into equal runs (multiples of 16, at least kMinSpreadRun) for at most eight
/// blocks per multiprocessor.
std::vector<SpreadLaunch> planSpread(std::span<const Segment> pieces, uint64_t aloneBytes,
                                     int multiprocessors, std::vector<Segment>& alone);

}  // namespace loom::cuda
