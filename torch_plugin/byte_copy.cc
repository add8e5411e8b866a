// loom._C.copy_cpu and copy_cuda: many tensor copies as one job, for the tensor store's reads
// and puts. On CPU, torch's copy_ writes through the cache, so each output line is read
// before it is written (3 bytes of memory traffic per byte copied); for copies larger than
// the last-level cache, loom's streaming copy skips that read, and one parallel region for
// all pairs keeps every thread busy when the pairs differ in size. On CUDA, one launch of
// loom's spread copy moves every pair with the bytes shared evenly by the blocks.

#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/python.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/copy.h"
#ifdef LOOM_HAVE_CUDA
#include <c10/core/impl/VirtualGuardImpl.h>

#include "cuda/spread_copy.h"
#endif

namespace py = pybind11;

namespace loom::torch_plugin {
namespace {

// One pair's bytes, and where they start in the job's running total.
struct Span {
  uint8_t* dst;
  const uint8_t* src;
  size_t bytes;
  size_t start;
};

// The job is cut into slices of this many bytes (counted along the pairs laid end to end),
// which threads take in runs. Where a run ends inside a pair, two threads may write parts of
// one cache line: correct, and rare enough at this size not to cost.
constexpr size_t kSliceAlign = 4096;

// Throws unless every pair is two contiguous tensors of one dtype and size on `device`.
void checkPairs(const char* what, const std::vector<at::Tensor>& dsts,
                const std::vector<at::Tensor>& srcs, c10::DeviceType device) {
  if (dsts.size() != srcs.size()) {
    throw std::invalid_argument(std::string(what) + ": got " + std::to_string(dsts.size()) +
                                " destinations and " + std::to_string(srcs.size()) + " sources");
  }
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& d = dsts[i];
    const at::Tensor& s = srcs[i];
    if (d.device().type() != device || s.device() != d.device() || !d.is_contiguous() ||
        !s.is_contiguous() || d.scalar_type() != s.scalar_type() || d.numel() != s.numel()) {
      throw std::invalid_argument(std::string(what) + ": pair " + std::to_string(i) +
                                  " must be contiguous " + c10::DeviceTypeName(device) +
                                  " tensors of one device, dtype and size");
    }
  }
}

std::vector<Span> spansOf(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs) {
  checkPairs("copy_cpu", dsts, srcs, c10::DeviceType::CPU);
  std::vector<Span> spans;
  spans.reserve(dsts.size());
  size_t total = 0;
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& d = dsts[i];
    const at::Tensor& s = srcs[i];
    const size_t bytes = static_cast<size_t>(d.numel()) * d.element_size();
    if (bytes == 0) continue;
    spans.push_back({static_cast<uint8_t*>(d.data_ptr()), static_cast<const uint8_t*>(s.data_ptr()),
                     bytes, total});
    total += bytes;
  }
  return spans;
}

// Copies bytes [begin, end) of the job (the spans laid end to end).
void copyRange(const std::vector<Span>& spans, size_t begin, size_t end, bool streaming) {
  auto it = std::upper_bound(spans.begin(), spans.end(), begin,
                             [](size_t at, const Span& s) { return at < s.start; });
  for (--it; it != spans.end() && it->start < end; ++it) {
    const size_t from = std::max(begin, it->start) - it->start;
    const size_t to = std::min(end, it->start + it->bytes) - it->start;
    if (streaming) {
      kernels::copyStreaming(it->dst + from, it->src + from, to - from);
    } else {
      std::memcpy(it->dst + from, it->src + from, to - from);
    }
  }
}

}  // namespace

void bindByteCopy(py::module_& m) {
  m.def(
      "copy_cpu",
      [](const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs,
         size_t jobBytes) {
        const std::vector<Span> spans = spansOf(dsts, srcs);
        if (spans.empty()) return;
        const size_t total = spans.back().start + spans.back().bytes;
        // Output that cannot stay in cache anyway goes out through streaming stores.
        const bool streaming = std::max(total, jobBytes) >= kernels::lastLevelCacheBytes() / 2;
        const int64_t slices = static_cast<int64_t>((total + kSliceAlign - 1) / kSliceAlign);
        py::gil_scoped_release unlocked;
        // A grain of 64 KiB: small jobs stay on one thread, large ones spread over all.
        at::parallel_for(0, slices, 16, [&](int64_t first, int64_t last) {
          copyRange(spans, static_cast<size_t>(first) * kSliceAlign,
                    std::min(total, static_cast<size_t>(last) * kSliceAlign), streaming);
        });
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("job_bytes") = 0,
      "dst.copy_(src) for every pair of contiguous CPU tensors of one dtype and size, on "
      "torch's intra-op threads; streaming stores when these bytes, or those of the whole job "
      "this call is a bucket of (`job_bytes`), exceed half the last-level cache.");
#ifdef LOOM_HAVE_CUDA
  m.attr("has_cuda_copy") = true;
  m.def(
      "copy_cuda",
      [](const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs) {
        checkPairs("copy_cuda", dsts, srcs, c10::DeviceType::CUDA);
        if (dsts.empty()) return;
        const c10::Device device = dsts[0].device();
        for (const at::Tensor& d : dsts) {
          if (d.device() != device) {
            throw std::invalid_argument("copy_cuda: every pair must be on " + device.str());
          }
        }
        std::vector<cuda::Segment> pieces;
        pieces.reserve(dsts.size());
        for (size_t i = 0; i < dsts.size(); ++i) {
          pieces.push_back({dsts[i].data_ptr(), srcs[i].data_ptr(),
                            static_cast<uint64_t>(dsts[i].numel()) * dsts[i].element_size()});
        }
        // Queued on the caller's current stream, as copy_ would be.
        const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
        auto stream = static_cast<CUstream>(impl.getStream(device).native_handle());
        cuda::copySpread(device.index(), stream, pieces);
      },
      py::arg("dsts"), py::arg("srcs"),
      "dst.copy_(src) for every pair of contiguous tensors of one dtype and size on one CUDA "
      "device, queued on its current stream as one launch of loom's spread copy.");
#else
  m.attr("has_cuda_copy") = false;
#endif
}

}  // namespace loom::torch_plugin
