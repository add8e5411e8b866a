// Loading and launching loom's CUDA kernels.

#include "cuda/kernels.h"

#include <algorithm>
#include <climits>
#include <string>
#include <utility>
#include <vector>

#include "cuda/driver.h"
#include "cuda/kernel_image.h"
#include "loom/error.h"

namespace loom::cuda {

namespace {

constexpr unsigned kThreads = 512;
static_assert(sizeof(ReduceParams) <= 4096 && sizeof(CopyParams) <= 4096 &&
                  sizeof(FusedParams) <= 4096 && sizeof(FlagParams) <= 4096 &&
                  sizeof(SpreadParams) <= 4096 && sizeof(TransferParams) <= 4096,
              "kernel parameters must fit the 4 KiB every architecture accepts");
static_assert(kMaxSources <= kThreads, "one thread per published descriptor");

// Whether a launch has something to check or publish even with no data to move.
bool agrees(const Agreement& a) {
  return a.nexpect > 0 || a.npublish > 0;
}

// The bool kernels exist for the bitwise kinds; the other kinds map onto them.
ReduceKind boolKind(ReduceKind kind) {
  switch (kind) {
    case ReduceKind::kSum:
    case ReduceKind::kMax: return ReduceKind::kBitOr;
    case ReduceKind::kProduct:
    case ReduceKind::kMin: return ReduceKind::kBitAnd;
    default: return kind;
  }
}

}  // namespace

Kernels::Kernels() {
  const Driver& d = Driver::get();
  check(d.cuModuleLoadData(&module_, loom_kernel_image), "cuda", -1,
        "loading loom's kernels (cuModuleLoadData; does this build's image cover this GPU?)");
  check(d.cuModuleGetFunction(&copy_, module_, "loom_copy"), "cuda", -1, "finding loom_copy");
  check(d.cuModuleGetFunction(&flags_, module_, "loom_flags"), "cuda", -1, "finding loom_flags");
  check(d.cuModuleGetFunction(&copySpread_, module_, "loom_copy_spread"), "cuda", -1,
        "finding loom_copy_spread");
  for (int t = 0; t < kNumDataTypes; ++t) {
    for (int k = 0; k < kNumReduceKinds; ++k) {
      const auto type = static_cast<DataType>(t);
      const auto kind = static_cast<ReduceKind>(k);
      if (!isSupported(kind, type)) continue;
      const ReduceKind compiled = type == DataType::kBool ? boolKind(kind) : kind;
      const std::string suffix =
          std::to_string(t) + "_" + std::to_string(static_cast<int>(compiled));
      const size_t at = static_cast<size_t>(t * kNumReduceKinds + k);
      for (auto [table, prefix] :
           {std::pair{&reduce_, "loom_reduce_"}, std::pair{&fused_, "loom_fused_"}}) {
        const std::string name = prefix + suffix;
        check(d.cuModuleGetFunction(&(*table)[at], module_, name.c_str()), "cuda", -1,
              "finding " + name);
      }
    }
  }
  CUdevice device = 0;
  check(d.cuCtxGetDevice(&device), "cuda", -1, "cuCtxGetDevice");
  check(d.cuDeviceGetAttribute(&sms_, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device), "cuda", -1,
        "cuDeviceGetAttribute");
  check(d.cuModuleGetFunction(&fusedCopy_, module_, "loom_fused_copy"), "cuda", -1,
        "finding loom_fused_copy");
  check(d.cuModuleGetFunction(&fusedTransfer_, module_, "loom_fused_transfer"), "cuda", -1,
        "finding loom_fused_transfer");
  std::vector<CUfunction> fused(fused_.begin(), fused_.end());
  fused.push_back(fusedCopy_);
  fused.push_back(fusedTransfer_);
  residentFusedBlocks_ = INT_MAX;
  for (CUfunction fn : fused) {
    if (fn == nullptr) continue;
    int perSm = 0;
    check(d.cuOccupancyMaxActiveBlocksPerMultiprocessor(&perSm, fn, kThreads, 0), "cuda", -1,
          "cuOccupancyMaxActiveBlocksPerMultiprocessor");
    residentFusedBlocks_ = std::min(residentFusedBlocks_, perSm * sms_);
  }
  fusedFits_ = fusedFitsIn(residentFusedBlocks_);
}

Kernels::~Kernels() {
  if (module_ != nullptr) Driver::get().cuModuleUnload(module_);
}

void Kernels::reduce(CUstream stream, DataType type, ReduceKind kind,
                     const ReduceParams& params) const {
  CUfunction fn = reduce_[static_cast<size_t>(static_cast<int>(type) * kNumReduceKinds +
                                              static_cast<int>(kind))];
  if (fn == nullptr) {
    throw Error(ErrorCode::kInternal, "cuda", -1, "no kernel for this reduction");
  }
  if (params.count == 0 && !agrees(params.agreement)) return;
  // One 16-byte vector per thread per pass; enough blocks to fill the GPU, no more.
  const uint64_t vectors = (params.count * elementSize(type) + 15) / 16;
  const uint64_t wanted = (vectors + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(std::clamp<uint64_t>(wanted, 1, 4 * sms_));
  void* args[] = {const_cast<ReduceParams*>(&params)};
  check(Driver::get().cuLaunchKernel(fn, blocks, 1, 1, kThreads, 1, 1, 0, stream, args, nullptr),
        "cuda", -1, "launching a reduction");
}

void Kernels::fusedReduce(CUstream stream, DataType type, ReduceKind kind,
                          const FusedParams& params) const {
  launchFused(fused_[static_cast<size_t>(static_cast<int>(type) * kNumReduceKinds +
                                         static_cast<int>(kind))],
              stream, params);
}

void Kernels::fusedCopy(CUstream stream, const FusedParams& params) const {
  launchFused(fusedCopy_, stream, params);
}

void Kernels::launchFused(CUfunction fn, CUstream stream, const FusedParams& params) const {
  if (fn == nullptr || !fusedFits_ || params.blocks < 1 || params.blocks > kMaxFusedBlocks) {
    throw Error(ErrorCode::kInternal, "cuda", -1, "no fused kernel for this call");
  }
  // Cooperative: every block resident at once. A pushing block waits for a peer's receiving
  // block, and that one for the peer's pushing block, so a block the GPU has not placed yet
  // (other kernels occupying the SMs) must not be able to hold up one it has.
  void* args[] = {const_cast<FusedParams*>(&params)};
  check(Driver::get().cuLaunchCooperativeKernel(fn, fusedGridBlocks(params), 1, 1, kThreads, 1, 1,
                                                0, stream, args),
        "cuda", -1, "launching a fused collective");
}

void Kernels::fusedTransfer(CUstream stream, const TransferParams& params) const {
  const int grid = params.nstreams * params.blocks;
  if (!fusedFits_ || params.nstreams < 1 || params.blocks < 1 || params.blocks > kTransferPieces ||
      kTransferPieces % params.blocks != 0 || grid > 2 * kMaxFusedBlocks) {
    throw Error(ErrorCode::kInternal, "cuda", -1, "no fused transfer for this call");
  }
  // Cooperative, as launchFused: a sending block waits for a peer's receiving block, which
  // waits for the peer's sending block, so every block must be resident at once.
  void* args[] = {const_cast<TransferParams*>(&params)};
  check(Driver::get().cuLaunchCooperativeKernel(fusedTransfer_, static_cast<unsigned>(grid), 1, 1,
                                                kThreads, 1, 1, 0, stream, args),
        "cuda", -1, "launching a fused transfer");
}

void Kernels::copy(CUstream stream, const CopyParams& params, uint64_t longest) const {
  if ((params.count == 0 || longest == 0) && !agrees(params.agreement)) return;
  const unsigned segments = static_cast<unsigned>(std::max(params.count, 1));
  const uint64_t wanted = (longest / 16 + kThreads - 1) / kThreads;
  const unsigned perSegment =
      static_cast<unsigned>(std::clamp<uint64_t>(wanted, 1, std::max(1u, 4 * sms_ / segments)));
  void* args[] = {const_cast<CopyParams*>(&params)};
  check(Driver::get().cuLaunchKernel(copy_, perSegment, segments, 1, kThreads, 1, 1, 0, stream,
                                     args, nullptr),
        "cuda", -1, "launching a copy");
}

void Kernels::flags(CUstream stream, const FlagParams& params) const {
  void* args[] = {const_cast<FlagParams*>(&params)};
  check(Driver::get().cuLaunchKernel(flags_, 1, 1, 1, 1, 1, 1, 0, stream, args, nullptr), "cuda",
        -1, "launching flag waits");
}

void Kernels::copySpread(CUstream stream, const SpreadParams& params, unsigned blocks) const {
  if (params.count == 0 || blocks == 0) return;
  void* args[] = {const_cast<SpreadParams*>(&params)};
  check(Driver::get().cuLaunchKernel(copySpread_, blocks, 1, 1, kThreads, 1, 1, 0, stream, args,
                                     nullptr),
        "cuda", -1, "launching a spread copy");
}

}  // namespace loom::cuda
