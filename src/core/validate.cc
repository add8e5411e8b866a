// Argument checks.

#include "core/validate.h"

#include <cmath>
#include <cstdint>

#include "loom/error.h"

namespace loom::validate {

void fail(const Site& site, const std::string& detail) {
  throw Error(ErrorCode::kInvalidArgument, site.op, site.rank, detail);
}

void dataType(const Site& site, DataType type) {
  if (static_cast<unsigned>(type) >= static_cast<unsigned>(kNumDataTypes)) {
    fail(site, "argument 'type' holds " + std::to_string(static_cast<int>(type)) +
                   ", which is not a loom::DataType");
  }
}

void reduction(const Site& site, ReduceOp op, DataType type, DeviceKind device) {
  const int kind = static_cast<int>(op.kind());
  if (kind >= kNumReduceKinds) {
    fail(site, "argument 'op' holds " + std::to_string(kind) + ", which is not a loom::ReduceKind");
  }
  if (!isSupported(op.kind(), type)) {
    std::string hint = isFloatingPoint(type) ? "bitwise reductions need integer or bool data"
                       : op.kind() == ReduceKind::kPremulSum
                           ? "PREMUL_SUM needs floating-point data"
                           : "AVG is not defined for bool";
    fail(site, "reduction " + std::string(reduceKindName(op.kind())) + " is not supported for " +
                   std::string(dataTypeName(type)) + " (" + hint + ")");
  }
  if (op.kind() != ReduceKind::kPremulSum) return;
  if (op.deviceFactor() != nullptr) {
    // The value is the device's to read; a non-finite one gives non-finite sums, as NCCL's.
    if (device != DeviceKind::kCuda) {
      fail(site,
           "the PREMUL_SUM factor is in device memory but the buffers are host memory; "
           "pass the factor as a value (ReduceOp::premulSum)");
    }
  } else if (!std::isfinite(op.factor())) {
    fail(site, "the PREMUL_SUM factor must be finite");
  }
}

void rankInRange(const Site& site, const char* what, int rank) {
  if (rank < 0 || rank >= site.size) {
    fail(site, "argument '" + std::string(what) + "' is " + std::to_string(rank) +
                   ", outside [0, " + std::to_string(site.size) + ") for this communicator of " +
                   std::to_string(site.size) + " ranks");
  }
}

size_t bytesOf(const Site& site, const char* what, size_t count, DataType type) {
  const size_t es = elementSize(type);
  // Counts near SIZE_MAX usually come from a negative number converted to size_t. The bound
  // is per rank, so that callers may form size x count elements (all_gather's output,
  // reduce_scatter's input) and sums of per-rank counts without wrapping size_t.
  const size_t ranks = site.size > 1 ? static_cast<size_t>(site.size) : 1;
  if (count > (SIZE_MAX >> 2) / es / ranks) {
    fail(site, "argument '" + std::string(what) + "' is " + std::to_string(count) +
                   " elements, which cannot be in memory (a negative count converted to "
                   "size_t?)");
  }
  return count * es;
}

void buffer(const Site& site, const char* what, const void* ptr, size_t count) {
  if (ptr == nullptr && count > 0) {
    fail(site, "argument '" + std::string(what) + "' is null but " + std::to_string(count) +
                   " elements are to be accessed");
  }
}

void perRank(const Site& site, const char* what, size_t length) {
  if (length != static_cast<size_t>(site.size)) {
    fail(site, "argument '" + std::string(what) + "' has " + std::to_string(length) +
                   " entries; it needs one per rank (" + std::to_string(site.size) + ")");
  }
}

void noPartialOverlap(const Site& site, const char* a, const void* pa, size_t na, const char* b,
                      const void* pb, size_t nb, bool allowSame) {
  if (na == 0 || nb == 0 || pa == nullptr || pb == nullptr) return;
  const auto* x = static_cast<const uint8_t*>(pa);
  const auto* y = static_cast<const uint8_t*>(pb);
  if (x == y && na == nb && allowSame) return;
  if (x < y + nb && y < x + na) {
    fail(site, "buffers '" + std::string(a) + "' and '" + std::string(b) + "' overlap" +
                   (allowSame ? " partially; pass the same buffer for in-place or "
                                "disjoint buffers"
                              : "; pass disjoint buffers"));
  }
}

uint64_t hashCounts(std::span<const size_t> counts) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t c : counts) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint8_t>(static_cast<uint64_t>(c) >> (8 * i));
      h *= 0x100000001b3ULL;
    }
  }
  return h == 0 ? 1 : h;
}

}  // namespace loom::validate
