#pragma once

// loom's CUDA kernels (kernels.cu), loaded from the image embedded in the library into one
// context, and launched with their parameter structs.

#include <cuda.h>

#include <array>

#include "cuda/kernel_params.h"
#include "loom/types.h"

namespace loom::cuda {

class Kernels {
 public:
  /// Loads the kernels into the current context.
  Kernels();
  ~Kernels();
  Kernels(const Kernels&) = delete;
  Kernels& operator=(const Kernels&) = delete;

  /// Queues dst = reduce(srcs) on `stream` (see ReduceParams).
  void reduce(CUstream stream, DataType type, ReduceKind kind, const ReduceParams& params) const;
  /// Queues every segment's copy on `stream`; `longest` is the largest segment's bytes.
  void copy(CUstream stream, const CopyParams& params, uint64_t longest) const;
  /// Queues flag waits and writes relative to device counters (see FlagParams).
  void flags(CUstream stream, const FlagParams& params) const;
  /// Queues a whole reducing collective on `stream` as one cooperative launch (see
  /// FusedParams); only where fusedFits().
  void fusedReduce(CUstream stream, DataType type, ReduceKind kind,
                   const FusedParams& params) const;
  /// The same for a collective that only moves bytes (counts in bytes).
  void fusedCopy(CUstream stream, const FusedParams& params) const;
  /// Queues a call's sends and receives on `stream` as one cooperative launch (see
  /// TransferParams); only where fusedFits().
  void fusedTransfer(CUstream stream, const TransferParams& params) const;
  /// Whether every fused kernel can keep kMaxFusedBlocks block pairs resident
  /// at once on this device, as a cooperative launch needs (a fused transfer runs at most
  /// as many blocks).
  bool fusedFits() const { return fusedFits_; }
  /// Blocks of the fused kernels this device keeps resident at once (the least over them):
  /// what the grids of all the ranks that spin on it together must fit in.
  int residentFusedBlocks() const { return residentFusedBlocks_; }
  /// Queues the pieces' copy on `stream`, one run of params.perBlock bytes per block.
  void copySpread(CUstream stream, const SpreadParams& params, unsigned blocks) const;
  /// The device's streaming multiprocessors.
  int multiprocessors() const { return sms_; }

 private:
  void launchFused(CUfunction fn, CUstream stream, const FusedParams& params) const;

  CUmodule module_ = nullptr;
  CUfunction copy_ = nullptr;
  CUfunction flags_ = nullptr;
  CUfunction copySpread_ = nullptr;
  // By (type, kind); null where the pair is not supported.
  std::array<CUfunction, kNumDataTypes * kNumReduceKinds> reduce_{};
  std::array<CUfunction, kNumDataTypes * kNumReduceKinds> fused_{};
  CUfunction fusedCopy_ = nullptr;
  CUfunction fusedTransfer_ = nullptr;
  bool fusedFits_ = true;
  int residentFusedBlocks_ = 0;
  int sms_ = 0;
};

}  // namespace loom::cuda
