// CudaFusedTrace (cuda_fused_trace.h).

#include "core/cuda_fused_trace.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>

#include "cuda/driver.h"
#include "loom/error.h"

namespace loom {

namespace {
constexpr size_t timeBytes(uint64_t steps, int blocks) {
  return static_cast<size_t>(steps) * static_cast<size_t>(blocks) * cuda::kTracePhases *
         sizeof(uint64_t);
}
constexpr size_t recordBytes(uint64_t steps, int blocks) {
  return timeBytes(steps, blocks) + static_cast<size_t>(blocks) * sizeof(uint32_t);
}
}  // namespace

CudaFusedTrace::CudaFusedTrace(std::string prefix, int rank)
    : path_(std::move(prefix) + ".rank" + std::to_string(rank) + ".txt"), rank_(rank) {
  const cuda::Driver& d = cuda::Driver::get();
  void* host = nullptr;
  cuda::check(d.cuMemHostAlloc(&host, recordBytes(kSteps, kBlocks),
                               CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE),
              "cuda", rank, "cuMemHostAlloc (LOOM_CUDA_FUSED_TRACE)");
  host_ = static_cast<uint64_t*>(host);
  std::memset(host_, 0, recordBytes(kSteps, kBlocks));
  CUdeviceptr device = 0;
  if (d.cuMemHostGetDevicePointer(&device, host, 0) != CUDA_SUCCESS) {
    d.cuMemFreeHost(host);
    throw Error(ErrorCode::kSystem, "cuda", rank,
                "cuMemHostGetDevicePointer failed for LOOM_CUDA_FUSED_TRACE's record");
  }
  device_ = reinterpret_cast<uint64_t*>(device);
}

CudaFusedTrace::~CudaFusedTrace() {
  cuda::Driver::get().cuMemFreeHost(host_);
}

void CudaFusedTrace::attach(cuda::FusedParams& p, size_t elementBytes) {
  // Rows this call's blocks do not write (roles a rank does not play) must not keep an
  // earlier call's times. An earlier traced call still running would write over the
  // cleared record: trace calls one at a time (the probe synchronizes after each).
  std::memset(host_, 0, recordBytes(kSteps, kBlocks));
  p.trace = device_;
  p.traceSteps = kSteps;
  p.traceSms =
      reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(device_) + timeBytes(kSteps, kBlocks));
  last_ = p;
  elementBytes_ = elementBytes;
  attached_ = true;
}

void CudaFusedTrace::write() const {
  if (!attached_) return;
  std::FILE* f = std::fopen(path_.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "loom: rank %d could not write LOOM_CUDA_FUSED_TRACE's %s\n", rank_,
                 path_.c_str());
    return;
  }
  const cuda::FusedParams& p = last_;
  const int roles = p.chain ? 1 : p.twoShot ? 3 : 2;
  const uint64_t steps = std::min(p.steps, kSteps);
  std::fprintf(f,
               "# rank %d size %d two_shot %d chain %d root %d blocks %d roles %d steps %llu "
               "count %llu per_step %llu share %llu element_bytes %zu\n",
               p.rank, p.size, p.twoShot, p.chain, p.root, p.blocks, roles,
               static_cast<unsigned long long>(p.steps), static_cast<unsigned long long>(p.count),
               static_cast<unsigned long long>(p.perStep), static_cast<unsigned long long>(p.share),
               elementBytes_);
  const auto* sms = reinterpret_cast<const uint32_t*>(reinterpret_cast<const uint8_t*>(host_) +
                                                      timeBytes(kSteps, kBlocks));
  std::fprintf(f, "# role block sm step begin_ns first_wait_ns second_wait_ns end_ns\n");
  for (int b = 0; b < roles * p.blocks; ++b) {
    for (uint64_t s = 0; s < steps; ++s) {
      const uint64_t* t = host_ + (static_cast<uint64_t>(b) * kSteps + s) * cuda::kTracePhases;
      std::fprintf(f, "%d %d %u %llu %llu %llu %llu %llu\n", cuda::fusedRole(b, roles),
                   cuda::fusedRoleBlock(b, roles), sms[b], static_cast<unsigned long long>(s),
                   static_cast<unsigned long long>(t[0]), static_cast<unsigned long long>(t[1]),
                   static_cast<unsigned long long>(t[2]), static_cast<unsigned long long>(t[3]));
    }
  }
  std::fclose(f);
}

}  // namespace loom
