// Test inputs and the reference reduction.

#include "reference.h"

#include <cmath>
#include <cstring>
#include <type_traits>

#include "kernels/half.h"

namespace loom::testing {

namespace {

uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// A small integer in [-4, 4] unique-ish per (rank, index, salt).
int smallValue(int rank, size_t index, uint32_t salt) {
  const uint32_t h = mix(static_cast<uint32_t>(index) * 2654435761U ^ mix(salt + 1) ^
                         (static_cast<uint32_t>(rank) * 0x9e3779b9U));
  return static_cast<int>(h % 9) - 4;
}

// A float input: a multiple of 1/8 in [-4, 4]: exact in bf16 and fp16, and sums of a few
// such values are exact too.
float floatValue(int rank, size_t index, uint32_t salt) {
  const uint32_t h = mix(static_cast<uint32_t>(index) ^ mix(salt * 31 + 7) ^
                         (static_cast<uint32_t>(rank + 1) * 0x85ebca6bU));
  return static_cast<float>(static_cast<int>(h % 65) - 32) / 8.0f;
}

template <class T>
void fillTyped(T* out, DataType type, size_t count, int rank, uint32_t salt, size_t offset) {
  for (size_t i = 0; i < count; ++i) {
    const size_t index = offset + i;
    if constexpr (std::is_same_v<T, uint16_t>) {
      const float f = floatValue(rank, index, salt);
      out[i] = type == DataType::kFloat16 ? kernels::floatToFp16(f) : kernels::floatToBf16(f);
    } else if constexpr (std::is_floating_point_v<T>) {
      out[i] = static_cast<T>(floatValue(rank, index, salt));
    } else {
      if (type == DataType::kBool) {
        out[i] = static_cast<T>(smallValue(rank, index, salt) > 0 ? 1 : 0);
      } else if (std::is_unsigned_v<T>) {
        out[i] = static_cast<T>(smallValue(rank, index, salt) + 4);
      } else {
        out[i] = static_cast<T>(smallValue(rank, index, salt));
      }
    }
  }
}

template <class T>
T wrapAdd(T a, T b) {
  using U = std::conditional_t<(sizeof(T) < 4), uint32_t, std::make_unsigned_t<T>>;
  return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
}

template <class T>
T wrapMul(T a, T b) {
  using U = std::conditional_t<(sizeof(T) < 4), uint32_t, std::make_unsigned_t<T>>;
  return static_cast<T>(static_cast<U>(a) * static_cast<U>(b));
}

template <class A>
A combineRef(ReduceKind kind, A a, A b) {
  switch (kind) {
    case ReduceKind::kSum:
    case ReduceKind::kAvg:
    case ReduceKind::kPremulSum:
      if constexpr (std::is_integral_v<A>)
        return wrapAdd(a, b);
      else
        return a + b;
    case ReduceKind::kProduct:
      if constexpr (std::is_integral_v<A>)
        return wrapMul(a, b);
      else
        return a * b;
    case ReduceKind::kMin:
      if constexpr (std::is_floating_point_v<A>) {
        if (std::isnan(a)) return a;
        if (std::isnan(b)) return b;
      }
      return b < a ? b : a;
    case ReduceKind::kMax:
      if constexpr (std::is_floating_point_v<A>) {
        if (std::isnan(a)) return a;
        if (std::isnan(b)) return b;
      }
      return b > a ? b : a;
    case ReduceKind::kBitAnd:
      if constexpr (std::is_integral_v<A>) return static_cast<A>(a & b);
      break;
    case ReduceKind::kBitOr:
      if constexpr (std::is_integral_v<A>) return static_cast<A>(a | b);
      break;
    case ReduceKind::kBitXor:
      if constexpr (std::is_integral_v<A>) return static_cast<A>(a ^ b);
      break;
  }
  return a;
}

// Storage T, accumulator A; `load` and `store` convert.
template <class T, class A, class Load, class Store>
void referenceTyped(T* out, DataType type, ReduceOp op, size_t count, int size, uint32_t salt,
                    size_t offset, Load load, Store store) {
  std::vector<std::vector<T>> inputs(static_cast<size_t>(size), std::vector<T>(count));
  for (int r = 0; r < size; ++r) fillTyped(inputs[r].data(), type, count, r, salt, offset);
  const A factor = static_cast<A>(op.factor());
  for (size_t i = 0; i < count; ++i) {
    A acc = load(inputs[0][i]);
    if (op.kind() == ReduceKind::kPremulSum) acc = acc * factor;
    for (int r = 1; r < size; ++r) {
      A x = load(inputs[r][i]);
      if (op.kind() == ReduceKind::kPremulSum) x = x * factor;
      acc = combineRef<A>(op.kind(), acc, x);
    }
    if (op.kind() == ReduceKind::kAvg) acc = acc / static_cast<A>(size);
    out[i] = store(acc);
  }
}

template <class T>
void referenceInteger(void* out, DataType type, ReduceOp op, size_t count, int size, uint32_t salt,
                      size_t offset) {
  auto* o = static_cast<T*>(out);
  if (op.kind() == ReduceKind::kAvg) {
    referenceTyped<T, int64_t>(
        o, type, op, count, size, salt, offset, [](T v) { return static_cast<int64_t>(v); },
        [](int64_t a) { return static_cast<T>(a); });
  } else {
    referenceTyped<T, T>(
        o, type, op, count, size, salt, offset, [](T v) { return v; }, [](T a) { return a; });
  }
}

}  // namespace

void fillInput(void* out, DataType type, size_t count, int rank, uint32_t salt, size_t offset) {
  switch (type) {
    case DataType::kFloat32:
      return fillTyped(static_cast<float*>(out), type, count, rank, salt, offset);
    case DataType::kFloat64:
      return fillTyped(static_cast<double*>(out), type, count, rank, salt, offset);
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return fillTyped(static_cast<uint16_t*>(out), type, count, rank, salt, offset);
    case DataType::kInt8:
      return fillTyped(static_cast<int8_t*>(out), type, count, rank, salt, offset);
    case DataType::kUInt8:
    case DataType::kBool:
      return fillTyped(static_cast<uint8_t*>(out), type, count, rank, salt, offset);
    case DataType::kInt16:
      return fillTyped(static_cast<int16_t*>(out), type, count, rank, salt, offset);
    case DataType::kInt32:
      return fillTyped(static_cast<int32_t*>(out), type, count, rank, salt, offset);
    case DataType::kInt64:
      return fillTyped(static_cast<int64_t*>(out), type, count, rank, salt, offset);
  }
}

std::vector<uint8_t> inputBytes(DataType type, size_t count, int rank, uint32_t salt,
                                size_t offset) {
  std::vector<uint8_t> bytes(count * elementSize(type));
  fillInput(bytes.data(), type, count, rank, salt, offset);
  return bytes;
}

std::vector<uint8_t> referenceReduce(DataType type, ReduceOp op, size_t count, int size,
                                     uint32_t salt, size_t offset) {
  std::vector<uint8_t> out(count * elementSize(type));
  void* o = out.data();
  switch (type) {
    case DataType::kFloat32:
      referenceTyped<float, float>(
          static_cast<float*>(o), type, op, count, size, salt, offset, [](float v) { return v; },
          [](float a) { return a; });
      break;
    case DataType::kFloat64:
      referenceTyped<double, double>(
          static_cast<double*>(o), type, op, count, size, salt, offset, [](double v) { return v; },
          [](double a) { return a; });
      break;
    case DataType::kFloat16:
      referenceTyped<uint16_t, float>(static_cast<uint16_t*>(o), type, op, count, size, salt,
                                      offset, kernels::fp16ToFloat, kernels::floatToFp16);
      break;
    case DataType::kBFloat16:
      referenceTyped<uint16_t, float>(static_cast<uint16_t*>(o), type, op, count, size, salt,
                                      offset, kernels::bf16ToFloat, kernels::floatToBf16);
      break;
    case DataType::kInt8: referenceInteger<int8_t>(o, type, op, count, size, salt, offset); break;
    case DataType::kUInt8: referenceInteger<uint8_t>(o, type, op, count, size, salt, offset); break;
    case DataType::kInt16: referenceInteger<int16_t>(o, type, op, count, size, salt, offset); break;
    case DataType::kInt32: referenceInteger<int32_t>(o, type, op, count, size, salt, offset); break;
    case DataType::kInt64: referenceInteger<int64_t>(o, type, op, count, size, salt, offset); break;
    case DataType::kBool: {
      // Bool reductions are logical: SUM/MAX/BOR = or, PRODUCT/MIN/BAND = and, BXOR = xor.
      ReduceKind kind = op.kind();
      if (kind == ReduceKind::kSum || kind == ReduceKind::kMax) kind = ReduceKind::kBitOr;
      if (kind == ReduceKind::kProduct || kind == ReduceKind::kMin) kind = ReduceKind::kBitAnd;
      referenceInteger<uint8_t>(o, type, ReduceOp(kind), count, size, salt, offset);
      break;
    }
  }
  return out;
}

std::string firstDifference(const void* got, const void* want, DataType type, size_t count) {
  const size_t es = elementSize(type);
  const auto* g = static_cast<const uint8_t*>(got);
  const auto* w = static_cast<const uint8_t*>(want);
  for (size_t i = 0; i < count; ++i) {
    if (std::memcmp(g + i * es, w + i * es, es) == 0) continue;
    auto hex = [&](const uint8_t* p) {
      std::string s = "0x";
      static const char* digits = "0123456789abcdef";
      for (size_t b = es; b-- > 0;) {
        s += digits[p[b] >> 4];
        s += digits[p[b] & 15];
      }
      return s;
    };
    return "element " + std::to_string(i) + " of " + std::to_string(count) + " (" +
           std::string(dataTypeName(type)) + "): got " + hex(g + i * es) + ", want " +
           hex(w + i * es);
  }
  return "";
}

std::string allGatherDifference(const void* out, DataType type, size_t count, int size,
                                uint32_t salt) {
  const auto* blocks = static_cast<const uint8_t*>(out);
  for (int q = 0; q < size; ++q) {
    const auto want = inputBytes(type, count, q, salt);
    const std::string diff =
        firstDifference(blocks + q * count * elementSize(type), want.data(), type, count);
    if (!diff.empty()) return "block " + std::to_string(q) + ": " + diff;
  }
  return {};
}

std::vector<DataType> allTypes() {
  std::vector<DataType> types;
  for (int t = 0; t < kNumDataTypes; ++t) types.push_back(static_cast<DataType>(t));
  return types;
}

std::vector<ReduceOp> reductionsFor(DataType type) {
  std::vector<ReduceOp> ops;
  for (int k = 0; k < kNumReduceKinds; ++k) {
    const auto kind = static_cast<ReduceKind>(k);
    if (!isSupported(kind, type)) continue;
    ops.push_back(kind == ReduceKind::kPremulSum ? ReduceOp::premulSum(0.5) : ReduceOp(kind));
  }
  return ops;
}

}  // namespace loom::testing
