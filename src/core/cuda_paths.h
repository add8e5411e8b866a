#pragma once

// Which ways a communicator's CUDA calls take, from where its ranks sit: one-shot or two-shot
// all_reduce, one stream or two, fused kernels or steps (and up to what size), and how many
// blocks a fused grid may take. Every rank reads the same facts (every rank's GPU, whether its
// process is an MPS client and how many fused blocks its GPU keeps resident, told with the
// workspaces), so all reach the same choices.
// The measurements behind each default are in docs/PERFORMANCE.md; CudaExecutor applies them.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/config.h"
#include "cuda/kernel_params.h"

namespace loom::detail {

/// All reductions up to this many bytes read every peer's whole slot (one-shot: one
/// synchronisation); larger ones reduce a share each and gather the shares (two-shot).
/// Ranks that share one GPU always go one-shot: they take turns on it, and a second round of
/// waits costs a switch between processes (about 135 us on an H100) while re-reading every
/// input costs little; under MPS, which runs them side by side, two-shot from 256 KiB still
/// took 1.1-1.9x one-shot's time on one H200. So do two ranks: each reads its peer's whole
/// piece one-shot, as many bytes as a share and the peer's reduced share two-shot, with one
/// round of waits and one launch fewer.
inline constexpr size_t kOneShotBytes = 256 << 10;

/// A communicator's CUDA paths (CudaExecutor's fields of the same names).
struct CudaPaths {
  size_t oneShotBytes = kOneShotBytes;          ///< the largest all_reduce reduced one-shot
  bool pipelined = false;                       ///< a call's steps alternate between two streams
  bool fused = false;                           ///< eager calls may run as one fused kernel each
  bool fusedTransfers = false;                  ///< and their sends and receives too
  size_t fusedMostBytes = SIZE_MAX;             ///< a fused collective's largest buffer
  int fusedBlocks = cuda::kMaxFusedBlocks;      ///< most block pairs per fused kernel
  int twoShotBlocks = cuda::kMaxTwoShotBlocks;  ///< most blocks per role of a two-shot call
  int crowd = 1;                                ///< the most ranks on one GPU
  bool takingTurns = false;  ///< ranks share a GPU without MPS: the GPU runs them in turns
};

/// The paths for ranks on GPUs `devices` (every rank's ordinal, by rank), all MPS clients or
/// not, where the least of their GPUs keeps `residentFusedBlocks` fused blocks at once and
/// every one fits a fused call (`fusedFits`; cuda::fusedFitsIn), as `tuning` asks.
inline CudaPaths chooseCudaPaths(const CudaTuning& tuning, std::span<const int> devices,
                                 bool everyRankUnderMps, int residentFusedBlocks, bool fusedFits) {
  std::vector<int> sorted(devices.begin(), devices.end());
  std::sort(sorted.begin(), sorted.end());
  int crowd = 0;
  for (auto at = sorted.begin(); at != sorted.end();) {
    const auto end = std::upper_bound(at, sorted.end(), *at);
    crowd = std::max(crowd, static_cast<int>(end - at));
    at = end;
  }
  CudaPaths p;
  p.crowd = crowd;
  const int ranks = static_cast<int>(devices.size());
  const bool oneGpu = crowd == ranks;  // every rank on the same GPU
  const bool ownGpus = crowd == 1;
  p.takingTurns = !ownGpus && !everyRankUnderMps;
  p.oneShotBytes = tuning.oneShotBytes.value_or(oneGpu || ranks == 2 ? SIZE_MAX : kOneShotBytes);
  // Ranks that take turns on a GPU leave a second stream nobody's waits to fill. Under MPS
  // they do not, and at 32 MiB two streams took 0.71-0.86x one's time at P = 2 and 0.90-1.01x
  // at P = 4 (broadcast 1.12-1.21x and 1.02-1.04x; "Ranks side by side on one GPU: MPS").
  p.pipelined = tuning.pipelined.value_or(!oneGpu || everyRankUnderMps);
  // A fused call's blocks spin on their peers' flags: where ranks take turns on a GPU, every
  // wait would stretch to a time slice. Under MPS the ranks' kernels run side by side, and
  // each rank's grids take their share of the blocks the GPU keeps resident, so that the
  // grids of all the ranks on it fit at once: a block still waiting for room would hold up
  // the peers' blocks that spin waiting for it.
  const int gridShare = cuda::fusedGridShare(residentFusedBlocks, crowd);
  p.fusedBlocks = cuda::fusedBlocksWithin(gridShare, tuning.fusedBlocks);
  p.twoShotBlocks = cuda::twoShotBlocksWithin(gridShare, p.fusedBlocks);
  p.fused = tuning.fused.value_or(ownGpus || everyRankUnderMps) && fusedFits && gridShare >= 3;
  // A fused transfer runs a block at least for each peer it sends to or receives from, in
  // at most two roles of fusedBlocks: where a rank that talks to every peer both ways would
  // overrun its share (13 ranks or more on one H200 under MPS), every rank's transfers take
  // the steps (the two ends of a pair must move it alike).
  p.fusedTransfers = p.fused && ranks - 1 <= p.fusedBlocks;
  // Sharing a GPU, the stepped path's kernels may take all of it where a fused grid has its
  // share: from 2 MiB at P = 3 and 4 on one H200 under MPS the stepped path was the faster.
  // Forced on, every size.
  p.fusedMostBytes = ownGpus || tuning.fused ? SIZE_MAX : tuning.fusedSharedGpuBytes;
  return p;
}

}  // namespace loom::detail
