// The spread copy's launches, with one loaded copy of loom's kernels per device.

#include "cuda/spread_copy.h"

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda/driver.h"
#include "cuda/kernels.h"
#include "cuda/spread_plan.h"

namespace loom::cuda {

namespace {

// loom's kernels in a device's primary context, and that context.
struct Loaded {
  CUcontext context = nullptr;
  std::unique_ptr<Kernels> kernels;
};

// Loaded on first use and kept for the process's life (unloading at exit could run after the
// driver has shut down).
const Loaded& loadedOn(int device) {
  static std::mutex mutex;
  static auto* loaded = new std::map<int, Loaded>();
  std::lock_guard<std::mutex> lock(mutex);
  Loaded& on = (*loaded)[device];
  if (on.kernels == nullptr) {
    const Driver& d = Driver::get();
    CUdevice dev = 0;
    check(d.cuDeviceGet(&dev, device), "copy", -1, "cuDeviceGet");
    check(d.cuDevicePrimaryCtxRetain(&on.context, dev), "copy", -1, "cuDevicePrimaryCtxRetain");
    ContextGuard guard(on.context);
    on.kernels = std::make_unique<Kernels>();
  }
  return on;
}

}  // namespace

void copySpread(int device, CUstream stream, std::span<const Segment> pieces, uint64_t aloneBytes) {
  const Loaded& on = loadedOn(device);
  ContextGuard guard(on.context);
  const Driver& d = Driver::get();
  std::vector<Segment> alone;
  const std::vector<SpreadLaunch> launches =
      planSpread(pieces, aloneBytes, on.kernels->multiprocessors(), alone);
  for (const Segment& piece : alone) {
    check(d.cuMemcpyDtoDAsync(reinterpret_cast<CUdeviceptr>(piece.dst),
                              reinterpret_cast<CUdeviceptr>(piece.src), piece.bytes, stream),
          "copy", -1, "cuMemcpyDtoDAsync");
  }
  for (const SpreadLaunch& launch : launches) {
    on.kernels->copySpread(stream, launch.params, launch.blocks);
  }
}

}  // namespace loom::cuda
