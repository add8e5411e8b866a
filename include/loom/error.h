#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace loom {

/// What went wrong, so callers can react without parsing the message.
enum class ErrorCode {
  kInvalidArgument,  ///< the caller passed something wrong; nothing was sent
  kMismatch,         ///< ranks issued different collectives, counts, types or roots
  kTimeout,          ///< an operation did not finish within its timeout
  kPeerFailure,      ///< a peer process exited or closed its connection
  kAborted,          ///< the communicator was aborted or shut down
  kSystem,           ///< an operating-system call failed
  kUnsupported,      ///< valid request that this build or platform cannot do
  kInternal,         ///< a bug in loom
};

/// Name of an error code ("invalid argument", "timeout", ...).
std::string_view errorCodeName(ErrorCode code);

/// The one exception type loom throws. The message names the operation, the rank and what
/// to do; the fields carry the same facts for programs.
class Error : public std::runtime_error {
 public:
  /// `op` is the operation ("all_reduce", "create", ...); `rank` is the caller's rank or -1.
  Error(ErrorCode code, std::string_view op, int rank, std::string_view detail);

  ErrorCode code() const { return code_; }
  const std::string& op() const { return op_; }
  int rank() const { return rank_; }
  /// The message without the "loom <op> (rank r): " prefix.
  const std::string& detail() const { return detail_; }

 private:
  ErrorCode code_;
  std::string op_;
  int rank_;
  std::string detail_;
};

}  // namespace loom
