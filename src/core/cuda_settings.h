#pragma once

// What the ranks of one host must agree on before they share CUDA workspaces: the LOOM_CUDA_*
// settings (CudaTuning) that lay out every rank's workspace and choose the paths its kernels
// take. Ranks read them from their own environment; one rank with another chunk size would
// address its peers' slots at other offsets (wrong answers, or a fault), one with another
// threshold would wait in a protocol its peers do not run. So each rank's workspace offer
// carries its settings as a note (with whether its process is an MPS client, which may
// differ, and how many fused blocks its GPU keeps resident, which differs between GPU models:
// every rank takes the least, so that all choose the same kernels), and every rank compares
// them before it uses any workspace. Internal to the CUDA executor.

#include <optional>
#include <span>
#include <string>

#include "core/config.h"

namespace loom::detail {

/// The note a rank offers with its workspace: whether its process is an MPS client, the
/// fused blocks its GPU keeps resident at once (cuda::Kernels::residentFusedBlocks), and every
/// setting of `tuning` its peers must share (at most kMaxFdNote characters).
std::string cudaSettingsNote(const CudaTuning& tuning, bool mpsClient, int residentFusedBlocks);

/// Whether `note` (cudaSettingsNote's) says its process is an MPS client.
bool notesMpsClient(const std::string& note);

/// The resident fused blocks `note` (cudaSettingsNote's) gives, 0 if it gives none.
int notesResidentFusedBlocks(const std::string& note);

/// nullopt where every rank's note (by rank) carries the same settings; otherwise what to
/// tell the user: the first rank whose settings differ from rank 0's, the setting by its
/// environment variable, and both values.
std::optional<std::string> cudaSettingsDisagree(std::span<const std::string> notes);

}  // namespace loom::detail
