// Names and properties of data types and reduce kinds.

#include "loom/types.h"

namespace loom {

std::string_view dataTypeName(DataType type) {
  switch (type) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt16: return "int16";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kBool: return "bool";
  }
  return "unknown";
}

bool isFloatingPoint(DataType type) {
  return type == DataType::kFloat32 || type == DataType::kFloat64 || type == DataType::kFloat16 ||
         type == DataType::kBFloat16;
}

std::string_view reduceKindName(ReduceKind kind) {
  switch (kind) {
    case ReduceKind::kSum: return "SUM";
    case ReduceKind::kProduct: return "PRODUCT";
    case ReduceKind::kMin: return "MIN";
    case ReduceKind::kMax: return "MAX";
    case ReduceKind::kAvg: return "AVG";
    case ReduceKind::kPremulSum: return "PREMUL_SUM";
    case ReduceKind::kBitAnd: return "BAND";
    case ReduceKind::kBitOr: return "BOR";
    case ReduceKind::kBitXor: return "BXOR";
  }
  return "unknown";
}

bool isSupported(ReduceKind kind, DataType type) {
  switch (kind) {
    case ReduceKind::kSum:
    case ReduceKind::kProduct:
    case ReduceKind::kMin:
    case ReduceKind::kMax: return true;
    case ReduceKind::kAvg: return type != DataType::kBool;
    case ReduceKind::kPremulSum: return isFloatingPoint(type);
    case ReduceKind::kBitAnd:
    case ReduceKind::kBitOr:
    case ReduceKind::kBitXor: return !isFloatingPoint(type);
  }
  return false;
}

}  // namespace loom
