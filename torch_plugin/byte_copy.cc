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
#include <optional>
#include <string>
#include <vector>

#include "kernels/copy.h"
#include "util/helper_pool.h"
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

// Each thread copies one share of the job (the pairs' bytes laid end to end), a multiple of
// this many bytes. Where a share ends inside a pair, two threads may write parts of one cache
// line: correct, and rare enough at this size not to cost.
constexpr size_t kShareAlign = 4096;
// Fewest bytes worth a thread of its own (waking a helper costs microseconds).
constexpr size_t kBytesPerThread = size_t{4} << 20;
// Plain copies go in pieces of at most this many bytes: glibc's memcpy switches to streaming
// stores past a size of its own choosing, and the caller chose plain ones.
constexpr size_t kPlainPiece = size_t{256} << 10;

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

std::vector<Span> spansOf(const std::vector<at::Tensor>& dsts,
                          const std::vector<at::Tensor>& srcs) {
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
      continue;
    }
    for (size_t at = from; at < to; at += kPlainPiece) {
      std::memcpy(it->dst + at, it->src + at, std::min(kPlainPiece, to - at));
    }
  }
}

}  // namespace

void bindByteCopy(py::module_& m) {
  m.def("last_level_cache_bytes", &kernels::lastLevelCacheBytes,
        "The last-level cache size loom's copies decide streaming stores by.");
  m.def(
      "copy_cpu",
      [](const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs, size_t jobBytes,
         std::optional<bool> streamingAsked) {
        const std::vector<Span> spans = spansOf(dsts, srcs);
        if (spans.empty()) return;
        const size_t total = spans.back().start + spans.back().bytes;
        // Output that cannot stay in cache anyway goes out through streaming stores.
        const bool streaming = streamingAsked.value_or(std::max(total, jobBytes) >=
                                                       kernels::lastLevelCacheBytes() / 2);
        // As many threads as torch's intra-op pool has, from loom's helper pool (torch's
        // at::parallel_for is an OpenMP region inlined into the caller, which this module,
        // built without OpenMP, would run on one thread).
        const int threads = static_cast<int>(std::clamp<size_t>(
            total / kBytesPerThread, 1, static_cast<size_t>(std::max(1, at::get_num_threads()))));
        const size_t share = (total / threads + kShareAlign - 1) / kShareAlign * kShareAlign;
        py::gil_scoped_release unlocked;
        HelperPool::instance().run(threads, threads, [&](int i) {
          const size_t begin = std::min(total, static_cast<size_t>(i) * share);
          copyRange(spans, begin, std::min(total, begin + share), streaming);
        });
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("job_bytes") = 0, py::arg("streaming") = py::none(),
      "dst.copy_(src) for every pair of contiguous CPU tensors of one dtype and size, on as "
      "many threads as torch's intra-op pool; with streaming stores if `streaming`, or, left "
      "None, when these bytes or those of the whole job this call is a bucket of "
      "(`job_bytes`) exceed half the last-level cache.");
#ifdef LOOM_HAVE_CUDA
  m.attr("has_cuda_copy") = true;
  m.def(
      "copy_cuda",
      [](const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs,
         uint64_t aloneBytes) {
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
        py::gil_scoped_release unlocked;
        cuda::copySpread(device.index(), stream, pieces, aloneBytes);
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("alone_bytes") = uint64_t{8} << 20,
      "dst.copy_(src) for every pair of contiguous tensors of one dtype and size on one CUDA "
      "device, queued on its current stream: pairs of `alone_bytes` or more each as the "
      "driver's copy, the rest as one launch of loom's spread copy.");
#else
  m.attr("has_cuda_copy") = false;
#endif
}

}  // namespace loom::torch_plugin
