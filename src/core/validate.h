#pragma once

// Argument checks shared by every public entry point. Each throws
// Error(kInvalidArgument, op, rank, ...) naming the argument, what is wrong and what to pass.

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "loom/types.h"

namespace loom::validate {

/// Where a check runs: the operation name and the caller's rank and group size.
struct Site {
  std::string_view op;
  int rank;
  int size;
};

[[noreturn]] void fail(const Site& site, const std::string& detail);

/// `type` is one of the DataType values.
void dataType(const Site& site, DataType type);
/// `op` is defined for `type`, and a PREMUL_SUM factor is finite, or in device memory only
/// for a call on `device` kCuda.
void reduction(const Site& site, ReduceOp op, DataType type, DeviceKind device);
/// 0 <= rank < size; `what` names the argument ("root", "peer").
void rankInRange(const Site& site, const char* what, int rank);
/// count * elementSize, times the group size, fits in memory; returns the byte size.
size_t bytesOf(const Site& site, const char* what, size_t count, DataType type);
/// A non-null pointer wherever count > 0.
void buffer(const Site& site, const char* what, const void* ptr, size_t count);
/// A per-rank list has exactly `size` entries.
void perRank(const Site& site, const char* what, size_t length);
/// Two byte ranges are identical (in place) or disjoint; `allowSame` says if identical is OK.
void noPartialOverlap(const Site& site, const char* a, const void* pa, size_t na, const char* b,
                      const void* pb, size_t nb, bool allowSame);

/// FNV-1a of a list of counts, for checking that every rank passed the same list.
uint64_t hashCounts(std::span<const size_t> counts);

}  // namespace loom::validate
