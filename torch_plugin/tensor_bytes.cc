// Which bytes a strided tensor covers: see tensor_bytes.h.

#include "tensor_bytes.h"

#include <algorithm>
#include <utility>

namespace loom::torch_plugin {
namespace {

using Run = std::pair<uintptr_t, uintptr_t>;  // [begin, end) in bytes

// The lowest byte and one past the highest that `t`'s elements cover.
Run extentOf(const TensorBytes& t) {
  int64_t lo = 0;
  int64_t hi = 0;
  for (size_t d = 0; d < t.sizes.size(); ++d) {
    if (t.sizes[d] == 0) return {0, 0};
    const int64_t reach = (t.sizes[d] - 1) * t.strides[d];
    (reach < 0 ? lo : hi) += reach;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.first);
  const auto es = static_cast<int64_t>(t.elementBytes);
  return {base + static_cast<uintptr_t>(lo * es), base + static_cast<uintptr_t>((hi + 1) * es)};
}

// `t`'s bytes as runs, sorted by start into `runs`; false, with `runs` unfilled, where there
// would be more than kMostRuns of them.
bool runsOf(const TensorBytes& t, std::vector<Run>& runs) {
  if (t.dense) {  // one run, whatever the order of its dimensions (channels-last, transposed)
    runs.push_back(extentOf(t));
    return true;
  }
  // The run is the dimension of stride 1 (or one element): the other dimensions enumerate.
  int runDim = -1;
  for (size_t d = 0; d < t.sizes.size(); ++d) {
    if (t.strides[d] == 1 && t.sizes[d] > 1) runDim = static_cast<int>(d);
  }
  const int64_t runLength = runDim < 0 ? 1 : t.sizes[static_cast<size_t>(runDim)];
  int64_t count = 1;
  for (size_t d = 0; d < t.sizes.size(); ++d) {
    if (static_cast<int>(d) == runDim) continue;
    if (t.sizes[d] == 0) return true;  // no element: no run
    count *= t.sizes[d];
    if (static_cast<size_t>(count) > kMostRuns) return false;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.first);
  const auto es = static_cast<int64_t>(t.elementBytes);
  std::vector<int64_t> index(t.sizes.size(), 0);
  runs.reserve(static_cast<size_t>(count));
  for (int64_t r = 0; r < count; ++r) {
    int64_t offset = 0;
    for (size_t d = 0; d < t.sizes.size(); ++d) offset += index[d] * t.strides[d];
    const uintptr_t begin = base + static_cast<uintptr_t>(offset * es);
    runs.push_back({begin, begin + static_cast<uintptr_t>(runLength * es)});
    // The next index of the enumerated dimensions, last fastest.
    for (size_t d = t.sizes.size(); d-- > 0;) {
      if (static_cast<int>(d) == runDim) continue;
      if (++index[d] < t.sizes[d]) break;
      index[d] = 0;
    }
  }
  std::sort(runs.begin(), runs.end());
  return true;
}

}  // namespace

TensorBytes TensorBytes::of(const at::Tensor& t) {
  TensorBytes b;
  b.first = static_cast<const uint8_t*>(t.data_ptr());
  b.elementBytes = t.element_size();
  b.sizes = t.sizes().vec();
  b.strides = t.strides().vec();
  b.dense = t.is_non_overlapping_and_dense();
  return b;
}

bool shareBytes(const TensorBytes& a, const TensorBytes& b) {
  const Run x = extentOf(a);
  const Run y = extentOf(b);
  if (x.first >= x.second || y.first >= y.second) return false;  // an empty tensor
  if (x.second <= y.first || y.second <= x.first) return false;
  std::vector<Run> ra;
  std::vector<Run> rb;
  if (!runsOf(a, ra) || !runsOf(b, rb)) return true;  // too many runs to tell: as the extents say
  // Both sorted by start: a sweep finds any two runs that meet.
  size_t i = 0;
  size_t j = 0;
  while (i < ra.size() && j < rb.size()) {
    if (ra[i].second <= rb[j].first) {
      ++i;
    } else if (rb[j].second <= ra[i].first) {
      ++j;
    } else {
      return true;
    }
  }
  return false;
}

}  // namespace loom::torch_plugin
