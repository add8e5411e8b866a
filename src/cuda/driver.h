#pragma once

// The CUDA driver API, loaded at run time: loom links no CUDA library, so one build runs
// on machines with and without a GPU. Driver::get() opens libcuda.so.1 on first use and
// resolves every entry point below by the symbol this build's cuda.h binds it to; a machine
// without a driver gets Error(kUnsupported) saying so.

#include <cuda.h>

#include <string_view>

namespace loom::cuda {

// Every driver entry point loom calls.
#define LOOM_CUDA_DRIVER_FUNCTIONS(X)            \
  X(cuInit)                                      \
  X(cuGetErrorName)                              \
  X(cuGetErrorString)                            \
  X(cuDeviceGet)                                 \
  X(cuDeviceGetAttribute)                        \
  X(cuDevicePrimaryCtxRetain)                    \
  X(cuDevicePrimaryCtxRelease)                   \
  X(cuCtxGetCurrent)                             \
  X(cuCtxSetCurrent)                             \
  X(cuCtxGetDevice)                              \
  X(cuMemGetAllocationGranularity)               \
  X(cuMemCreate)                                 \
  X(cuMemRelease)                                \
  X(cuMemExportToShareableHandle)                \
  X(cuMemImportFromShareableHandle)              \
  X(cuMemAddressReserve)                         \
  X(cuMemAddressFree)                            \
  X(cuMemMap)                                    \
  X(cuMemUnmap)                                  \
  X(cuMemSetAccess)                              \
  X(cuMemsetD8)                                  \
  X(cuMemHostAlloc)                              \
  X(cuMemFreeHost)                               \
  X(cuMemHostGetDevicePointer)                   \
  X(cuPointerGetAttribute)                       \
  X(cuModuleLoadData)                            \
  X(cuModuleUnload)                              \
  X(cuModuleGetFunction)                         \
  X(cuLaunchKernel)                              \
  X(cuLaunchCooperativeKernel)                   \
  X(cuOccupancyMaxActiveBlocksPerMultiprocessor) \
  X(cuMemcpyDtoDAsync)                           \
  X(cuMemcpyHtoDAsync)                           \
  X(cuMemcpyDtoHAsync)                           \
  X(cuStreamCreate)                              \
  X(cuStreamDestroy)                             \
  X(cuStreamSynchronize)                         \
  X(cuStreamWriteValue64)                        \
  X(cuStreamBatchMemOp)                          \
  X(cuStreamGetCaptureInfo)                      \
  X(cuThreadExchangeStreamCaptureMode)           \
  X(cuEventCreate)                               \
  X(cuEventDestroy)                              \
  X(cuEventRecord)                               \
  X(cuStreamWaitEvent)                           \
  X(cuStreamGetId)                               \
  X(cuCtxSynchronize)                            \
  X(cuEventQuery)

/// The loaded driver: one function pointer per entry point, named as in cuda.h.
struct Driver {
  /// The process's driver, loaded and initialised on first use. Throws Error(kUnsupported)
  /// if there is no CUDA driver here.
  static const Driver& get();

#define LOOM_CUDA_DECLARE(name) decltype(&::name) name = nullptr;
  LOOM_CUDA_DRIVER_FUNCTIONS(LOOM_CUDA_DECLARE)
#undef LOOM_CUDA_DECLARE
};

/// Throws Error(kSystem) for a failed driver call: "<what> failed: CUDA_ERROR_... (text)".
void check(CUresult result, std::string_view op, int rank, std::string_view what);

/// Makes device `device`'s primary context (the one PyTorch uses) current on this thread
/// for the guard's lifetime, restoring the previous one after.
class ContextGuard {
 public:
  ContextGuard(CUcontext context);
  ~ContextGuard();
  ContextGuard(const ContextGuard&) = delete;
  ContextGuard& operator=(const ContextGuard&) = delete;

 private:
  CUcontext previous_ = nullptr;
  bool switched_ = false;
};

/// Lets this thread make, for the guard's lifetime, the calls a CUDA graph capture in
/// global mode (torch.cuda.graph's default) forbids while any thread captures, such as
/// allocating or querying events: loom's own setup and polling belong to no capture.
class RelaxedCaptureGuard {
 public:
  RelaxedCaptureGuard();
  ~RelaxedCaptureGuard();
  RelaxedCaptureGuard(const RelaxedCaptureGuard&) = delete;
  RelaxedCaptureGuard& operator=(const RelaxedCaptureGuard&) = delete;

 private:
  CUstreamCaptureMode previous_ = CU_STREAM_CAPTURE_MODE_RELAXED;
};

}  // namespace loom::cuda
