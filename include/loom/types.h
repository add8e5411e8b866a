#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace loom {

/// Element types a collective can move or reduce.
enum class DataType : uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt8,
  kUInt8,
  kInt16,
  kInt32,
  kInt64,
  kBool,
};

/// Number of data types, for tables and sweeps.
inline constexpr int kNumDataTypes = 10;

/// Size in bytes of one element of `type` (inline: every call asks, several times).
constexpr size_t elementSize(DataType type) {
  switch (type) {
    case DataType::kFloat64:
    case DataType::kInt64: return 8;
    case DataType::kFloat32:
    case DataType::kInt32: return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kInt16: return 2;
    case DataType::kInt8:
    case DataType::kUInt8:
    case DataType::kBool: return 1;
  }
  return 0;
}

/// Lower-case name ("float32", "bfloat16", ...) for messages.
std::string_view dataTypeName(DataType type);

/// True for float32, float64, float16 and bfloat16.
bool isFloatingPoint(DataType type);

/// How a reduction combines elements.
enum class ReduceKind : uint8_t {
  kSum,
  kProduct,
  kMin,
  kMax,
  kAvg,        ///< sum divided by the number of ranks (integer types: truncating division)
  kPremulSum,  ///< each rank's input multiplied by a scalar factor, then summed
  kBitAnd,
  kBitOr,
  kBitXor,
};

/// Number of reduce kinds, for tables and sweeps.
inline constexpr int kNumReduceKinds = 9;

/// A reduction: its kind plus, for kPremulSum, the scalar factor (a value, or a double in
/// device memory that the device reads when the collective runs).
class ReduceOp {
 public:
  /// Implicit from a kind, so `ReduceKind::kSum` can be passed where a ReduceOp is expected.
  constexpr ReduceOp(ReduceKind kind = ReduceKind::kSum) : kind_(kind) {}  // NOLINT
  /// A PREMUL_SUM with the given factor.
  static constexpr ReduceOp premulSum(double factor) {
    return ReduceOp(ReduceKind::kPremulSum, factor);
  }
  /// A PREMUL_SUM whose factor is the double at `factor` in the memory of the GPU the
  /// collective runs on (CUDA calls only), read by the collective's kernels, so the host
  /// never waits for the value; it must stay valid until the call has run on its stream.
  static constexpr ReduceOp premulSumOnDevice(const double* factor) {
    ReduceOp op(ReduceKind::kPremulSum, 0.0);
    op.deviceFactor_ = factor;
    return op;
  }

  constexpr ReduceKind kind() const { return kind_; }
  /// The factor given as a value (meaningless where deviceFactor() is set).
  constexpr double factor() const { return factor_; }
  /// The factor's address in device memory, or null where it is a value.
  constexpr const double* deviceFactor() const { return deviceFactor_; }

 private:
  constexpr ReduceOp(ReduceKind kind, double factor) : kind_(kind), factor_(factor) {}
  ReduceKind kind_;
  double factor_ = 1.0;
  const double* deviceFactor_ = nullptr;
};

/// Upper-case name ("SUM", "PREMUL_SUM", ...) for messages.
std::string_view reduceKindName(ReduceKind kind);

/// True if `kind` is defined for `type` (bitwise ops only for integers and bool, AVG and
/// PREMUL_SUM only for numbers, PREMUL_SUM only for floating point).
bool isSupported(ReduceKind kind, DataType type);

/// Where a buffer lives. Only kCpu exists today; CUDA slots in beside it.
enum class DeviceKind : uint8_t { kCpu, kCuda };

}  // namespace loom
