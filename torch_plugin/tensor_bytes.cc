// Which bytes a strided tensor covers: see tensor_bytes.h.

#include "tensor_bytes.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <optional>
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

// A layout whose runs, enumerated from its outermost dimension in, come in ascending order of
// address without overlapping: every dimension's stride spans the whole block of the
// dimensions inside it (any slice or view of a contiguous tensor that keeps its order, a
// column or a face of a grid among them). Two such layouts are compared in one sweep, at any
// number of runs, with nothing stored.
struct Nested {
  uintptr_t first = 0;           // the lowest byte
  std::vector<int64_t> sizes;    // the enumerated dimensions, outermost (largest stride) first
  std::vector<int64_t> strides;  // in bytes, positive
  int64_t runBytes = 0;
};

// `t` as a Nested layout, or nullopt where it is not one (its dimensions interleave or
// overlap) or has no element.
std::optional<Nested> nestedOf(const TensorBytes& t) {
  const auto es = static_cast<int64_t>(t.elementBytes);
  auto first = reinterpret_cast<intptr_t>(t.first);
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride in bytes, size)
  for (size_t d = 0; d < t.sizes.size(); ++d) {
    if (t.sizes[d] == 0) return std::nullopt;
    // A repeated dimension covers no more bytes than one of its entries; a reversed one the
    // same bytes as forwards, from its last entry.
    if (t.sizes[d] == 1 || t.strides[d] == 0) continue;
    if (t.strides[d] < 0) first += (t.sizes[d] - 1) * t.strides[d] * es;
    dims.emplace_back(std::abs(t.strides[d]) * es, t.sizes[d]);
  }
  std::sort(dims.begin(), dims.end(), std::greater<>());
  Nested n;
  n.first = static_cast<uintptr_t>(first);
  n.runBytes = es;
  // The innermost dimensions that continue the run make it longer.
  while (!dims.empty() && dims.back().first == n.runBytes) {
    n.runBytes *= dims.back().second;
    dims.pop_back();
  }
  int64_t block = n.runBytes;  // bytes from the first to past the last of the dimensions within
  for (size_t d = dims.size(); d-- > 0;) {
    if (dims[d].first < block) return std::nullopt;
    block += (dims[d].second - 1) * dims[d].first;
  }
  for (const auto& [stride, size] : dims) {
    n.strides.push_back(stride);
    n.sizes.push_back(size);
  }
  return n;
}

// A Nested layout's runs, in ascending order.
class RunCursor {
 public:
  explicit RunCursor(const Nested& n) : n_(n), index_(n.sizes.size(), 0) {}
  bool done() const { return done_; }
  Run run() const { return {n_.first + offset_, n_.first + offset_ + n_.runBytes}; }
  void next() {
    for (size_t d = index_.size(); d-- > 0;) {
      offset_ += n_.strides[d];
      if (++index_[d] < n_.sizes[d]) return;
      offset_ -= index_[d] * n_.strides[d];
      index_[d] = 0;
    }
    done_ = true;
  }

 private:
  const Nested& n_;
  std::vector<int64_t> index_;
  uintptr_t offset_ = 0;
  bool done_ = false;
};

// Whether two Nested layouts share a byte: one sweep over both runs.
bool nestedShare(const Nested& a, const Nested& b) {
  RunCursor i(a);
  RunCursor j(b);
  while (!i.done() && !j.done()) {
    const Run x = i.run();
    const Run y = j.run();
    if (x.second <= y.first) {
      i.next();
    } else if (y.second <= x.first) {
      j.next();
    } else {
      return true;
    }
  }
  return false;
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
  const auto na = nestedOf(a);
  const auto nb = nestedOf(b);
  if (na && nb) return nestedShare(*na, *nb);
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
