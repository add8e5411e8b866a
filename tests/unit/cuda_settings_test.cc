// The LOOM_CUDA_* settings every rank of a host must share (core/cuda_settings.h): what a
// rank's workspace offer says, and the named refusal where two ranks' settings differ. The
// refusal on a GPU host: tests/cuda/check_cuda.py, part settings_differ.

#include "core/cuda_settings.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/fd_exchange.h"

namespace loom::detail {
namespace {

TEST(CudaSettings, RanksWithTheSameSettingsAgreeWhateverTheirMpsState) {
  CudaTuning forced;
  forced.fused = true;
  forced.oneShotBytes = 0;
  forced.chunkBytes = 65536;
  for (const CudaTuning& t : {CudaTuning{}, forced}) {
    const std::vector<std::string> notes{cudaSettingsNote(t, true), cudaSettingsNote(t, false),
                                         cudaSettingsNote(t, true)};
    EXPECT_EQ(cudaSettingsDisagree(notes), std::nullopt);
    EXPECT_TRUE(notesMpsClient(notes[0]));
    EXPECT_FALSE(notesMpsClient(notes[1]));
  }
  EXPECT_EQ(cudaSettingsDisagree(std::vector<std::string>{}), std::nullopt);
}

TEST(CudaSettings, TheFirstRankWhoseSettingDiffersIsNamedWithBothValues) {
  CudaTuning small;
  small.chunkBytes = 65536;
  const std::vector<std::string> notes{cudaSettingsNote({}, false), cudaSettingsNote({}, false),
                                       cudaSettingsNote(small, false)};
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
    const std::vector<std::string> notes{cudaSettingsNote({}, false),
                                         cudaSettingsNote(each[i], false)};
    const auto why = cudaSettingsDisagree(notes);
    ASSERT_TRUE(why.has_value()) << names[i];
    EXPECT_NE(why->find(std::string("rank 1's ") + names[i] + " is "), std::string::npos) << *why;
  }
  const std::vector<std::string> unset{cudaSettingsNote({}, false),
                                       cudaSettingsNote(each[3], false)};
  EXPECT_NE(cudaSettingsDisagree(unset)->find("is 1 but rank 0's is unset"), std::string::npos)
      << *cudaSettingsDisagree(unset);
  // A debug record each rank may keep or not is not compared.
  CudaTuning traced;
  traced.fusedTrace = "/tmp/trace";
  EXPECT_EQ(cudaSettingsDisagree(std::vector<std::string>{cudaSettingsNote({}, false),
                                                          cudaSettingsNote(traced, false)}),
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
  EXPECT_LE(cudaSettingsNote(widest, true).size(), kMaxFdNote) << cudaSettingsNote(widest, true);
}

}  // namespace
}  // namespace loom::detail
