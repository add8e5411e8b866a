#pragma once

// A debug timeline of the fused kernels (LOOM_CUDA_FUSED_TRACE): thread 0 of every block
// records the GPU's global time at each phase of each step (cuda::FusedParams' trace) into
// host memory the GPU writes directly, and the last traced call's record goes to a text
// file when the communicator ends. tests/cuda/fused_trace_probe.py reads the files and says
// where each role of the kernel spent its steps (waiting for which peer flag, or moving
// bytes). Off unless the variable is set; each call overwrites the one before.

#include <cstdint>
#include <memory>
#include <string>

#include "cuda/kernel_params.h"

namespace loom {

class CudaFusedTrace {
 public:
  /// Host memory for one call's record, for rank `rank` writing to `<prefix>.rank<rank>.txt`.
  /// Throws Error(kSystem) if the driver cannot map it.
  CudaFusedTrace(std::string prefix, int rank);
  ~CudaFusedTrace();
  CudaFusedTrace(const CudaFusedTrace&) = delete;
  CudaFusedTrace& operator=(const CudaFusedTrace&) = delete;

  /// Clears the record, points `p` (filled but for the trace) at it and remembers its shape.
  void attach(cuda::FusedParams& p, size_t elementBytes);
  /// Writes the last attached call's record; call only once the GPU is done with it.
  void write() const;

 private:
  static constexpr uint64_t kSteps = 1024;  // steps recorded per call (the first ones)
  static constexpr int kBlocks = 2 * cuda::kMaxFusedBlocks;

  const std::string path_;
  const int rank_;
  uint64_t* host_ = nullptr;  // kBlocks x kSteps x kTracePhases times, then kBlocks SM ids
  uint64_t* device_ = nullptr;
  cuda::FusedParams last_{};
  size_t elementBytes_ = 0;
  bool attached_ = false;
};

}  // namespace loom
