// The LOOM_CUDA_* settings every rank of a host must share (core/cuda_settings.h): what a
// rank's workspace offer says, and the named refusal where two ranks' settings differ. The
// refusal on a GPU host: tests/cuda/check_cuda.py, part settings_differ.

#include "core/cuda_settings.h"

#include <gtest/gtest.h>

#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "core/fd_exchange.h"

namespace loom::detail {
namespace {

constexpr int kResident = 264;  // an H200's fused blocks at once

TEST(CudaSettings, RanksWithTheSameSettingsAgreeWhateverTheirMpsState) {
  CudaTuning forced;
  forced.fused = true;
  forced.oneShotBytes = 0;
  forced.chunkBytes = 65536;
  for (const CudaTuning& t : {CudaTuning{}, forced}) {
    const std::vector<std::string> notes{cudaSettingsNote(t, true, kResident),
                                         cudaSettingsNote(t, false, kResident),
                                         cudaSettingsNote(t, true, kResident)};
    EXPECT_EQ(cudaSettingsDisagree(notes), std::nullopt);
    EXPECT_TRUE(notesMpsClient(notes[0]));
    EXPECT_FALSE(notesMpsClient(notes[1]));
  }
  EXPECT_EQ(cudaSettingsDisagree(std::vector<std::string>{}), std::nullopt);
}

TEST(CudaSettings, TheFirstRankWhoseSettingDiffersIsNamedWithBothValues) {
  CudaTuning small;
  small.chunkBytes = 65536;
  const std::vector<std::string> notes{cudaSettingsNote({}, false, kResident),
                                       cudaSettingsNote({}, false, kResident),
                                       cudaSettingsNote(small, false, kResident)};
  const auto why = cudaSettingsDisagree(notes);
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("rank 2's LOOM_CUDA_CHUNK_BYTES is 65536 but rank 0's is 8388608"),
            std::string::npos)
      << *why;
  EXPECT_NE(why->find("set them alike on every rank"), std::string::npos) << *why;
}

TEST(CudaSettings, EverySharedSettingIsComparedAndAnUnsetOneSaysSo) {
  std::vector<CudaTuning> each(10);
  each[0].chunkBytes = 1 << 20;
  each[1].oneShotBytes = 0;
  each[2].pipelined = false;
  each[3].fused = true;
  each[4].fusedSharedGpuBytes = 1;
  each[5].fusedBlocks = 8;
  each[6].fusedTwoShotBytes = 1;
  each[7].fusedTwoShotBroadcastBytes = 1;
  each[8].fusedChainBroadcastBytes = 1;
  each[9].fusedRingAllReduceBytes = 1;
  const char* const names[] = {"LOOM_CUDA_CHUNK_BYTES",
                               "LOOM_CUDA_ONE_SHOT_BYTES",
                               "LOOM_CUDA_PIPELINE",
                               "LOOM_CUDA_FUSED",
                               "LOOM_CUDA_FUSED_SHARED_GPU_BYTES",
                               "LOOM_CUDA_FUSED_BLOCKS",
                               "LOOM_CUDA_FUSED_TWO_SHOT_BYTES",
                               "LOOM_CUDA_FUSED_TWO_SHOT_BROADCAST_BYTES",
                               "LOOM_CUDA_FUSED_CHAIN_BROADCAST_BYTES",
                               "LOOM_CUDA_FUSED_RING_ALL_REDUCE_BYTES"};
  for (size_t i = 0; i < each.size(); ++i) {
    const std::vector<std::string> notes{cudaSettingsNote({}, false, kResident),
                                         cudaSettingsNote(each[i], false, kResident)};
    const auto why = cudaSettingsDisagree(notes);
    ASSERT_TRUE(why.has_value()) << names[i];
    EXPECT_NE(why->find(std::string("rank 1's ") + names[i] + " is "), std::string::npos) << *why;
  }
  const std::vector<std::string> unset{cudaSettingsNote({}, false, kResident),
                                       cudaSettingsNote(each[3], false, kResident)};
  EXPECT_NE(cudaSettingsDisagree(unset)->find("is 1 but rank 0's is unset"), std::string::npos)
      << *cudaSettingsDisagree(unset);
  // A debug record each rank may keep or not is not compared.
  CudaTuning traced;
  traced.fusedTrace = "/tmp/trace";
  EXPECT_EQ(
      cudaSettingsDisagree(std::vector<std::string>{cudaSettingsNote({}, false, kResident),
                                                    cudaSettingsNote(traced, false, kResident)}),
      std::nullopt);
}

TEST(CudaSettings, TheWidestSettingsFitInAnOffersNote) {
  CudaTuning widest;
  widest.chunkBytes = size_t{1} << 30;
  widest.oneShotBytes = SIZE_MAX;
  widest.pipelined = true;
  widest.fused = true;
  widest.fusedSharedGpuBytes = SIZE_MAX;
  widest.fusedBlocks = 64;
  widest.fusedTwoShotBytes = SIZE_MAX;
  widest.fusedTwoShotBroadcastBytes = SIZE_MAX;
  widest.fusedChainBroadcastBytes = SIZE_MAX;
  widest.fusedRingAllReduceBytes = SIZE_MAX;
  EXPECT_LE(cudaSettingsNote(widest, true, INT_MAX).size(), kMaxFdNote)
      << cudaSettingsNote(widest, true, INT_MAX);
}

// Each rank's resident fused blocks travel with its note (every rank takes the least over
// them, so that ranks on different GPU models choose the same kernels); they are the rank's
// own fact, not a setting to agree on.
TEST(CudaSettings, ANoteCarriesItsGpusResidentBlocksWhichMayDiffer) {
  const std::vector<std::string> notes{cudaSettingsNote({}, true, 264),
                                       cudaSettingsNote({}, false, 114),
                                       cudaSettingsNote({}, false, 0)};
  EXPECT_EQ(notesResidentFusedBlocks(notes[0]), 264) << notes[0];
  EXPECT_EQ(notesResidentFusedBlocks(notes[1]), 114) << notes[1];
  EXPECT_EQ(notesResidentFusedBlocks(notes[2]), 0) << notes[2];
  EXPECT_TRUE(notesMpsClient(notes[0]));
  EXPECT_FALSE(notesMpsClient(notes[1]));
  EXPECT_EQ(cudaSettingsDisagree(notes), std::nullopt);
  EXPECT_EQ(notesResidentFusedBlocks(cudaSettingsNote({}, false, INT_MAX)), INT_MAX);
  // A note without the count (or with garbage for it) gives none: no fused kernels.
  EXPECT_EQ(notesResidentFusedBlocks("mps c=1"), 0);
  EXPECT_EQ(notesResidentFusedBlocks("- c=1:99"), 0);
  EXPECT_EQ(notesResidentFusedBlocks("-:99999999999 c=1"), 0);
}

}  // namespace
}  // namespace loom::detail
