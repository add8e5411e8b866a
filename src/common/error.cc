// The loom::Error exception.

#include "loom/error.h"

#include <string>

namespace loom {

std::string_view errorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kMismatch: return "ranks disagree";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kPeerFailure: return "peer failure";
    case ErrorCode::kAborted: return "aborted";
    case ErrorCode::kSystem: return "system error";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kInternal: return "internal error";
  }
  return "error";
}

namespace {

std::string format(std::string_view op, int rank, std::string_view detail) {
  std::string s = "loom ";
  s += op;
  if (rank >= 0) s += " (rank " + std::to_string(rank) + ")";
  s += ": ";
  s += detail;
  return s;
}

}  // namespace

Error::Error(ErrorCode code, std::string_view op, int rank, std::string_view detail)
    : std::runtime_error(format(op, rank, detail)),
      code_(code),
      op_(op),
      rank_(rank),
      detail_(detail) {}

}  // namespace loom
