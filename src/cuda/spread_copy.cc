// The spread copy's launches, with one loaded copy of loom's kernels per device.

#include "cuda/spread_copy.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda/driver.h"
#include "cuda/kernels.h"

namespace loom::cuda {

namespace {

// Fewest bytes a block copies: below this, launching more blocks costs more than it spreads.
constexpr uint64_t kMinPerBlock = uint64_t{64} << 10;

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

uint64_t alignedUp(uint64_t bytes) {
  return (bytes + 15) / 16 * 16;
}

}  // namespace

void copySpread(int device, CUstream stream, std::span<const Segment> pieces, uint64_t aloneBytes) {
  const Loaded& on = loadedOn(device);
  ContextGuard guard(on.context);
  const Driver& d = Driver::get();
  std::vector<Segment> rest;
  rest.reserve(pieces.size());
  for (const Segment& piece : pieces) {
    if (piece.bytes < aloneBytes) {
      rest.push_back(piece);
      continue;
    }
    check(d.cuMemcpyDtoDAsync(reinterpret_cast<CUdeviceptr>(piece.dst),
                              reinterpret_cast<CUdeviceptr>(piece.src), piece.bytes, stream),
          "copy", -1, "cuMemcpyDtoDAsync");
  }
  pieces = rest;
  while (!pieces.empty()) {
    SpreadParams params{};
    uint64_t total = 0;
    size_t used = 0;
    for (; used < pieces.size() && params.count < kMaxSpreadPieces; ++used) {
      const Segment& piece = pieces[used];
      if (piece.bytes == 0) continue;
      params.pieces[params.count] = piece;
      params.starts[params.count] = total;
      ++params.count;
      total += alignedUp(piece.bytes);  // every piece starts 16-aligned in the whole
    }
    pieces = pieces.subspan(used);
    if (total == 0) continue;
    const auto most = static_cast<uint64_t>(8 * on.kernels->multiprocessors());
    const uint64_t blocks =
        std::clamp<uint64_t>((total + kMinPerBlock - 1) / kMinPerBlock, 1, most);
    params.perBlock = alignedUp((total + blocks - 1) / blocks);
    on.kernels->copySpread(stream, params,
                           static_cast<unsigned>((total + params.perBlock - 1) / params.perBlock));
  }
}

}  // namespace loom::cuda
