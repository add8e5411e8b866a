#pragma once

// What Work.getDuration() answers for loom's works (torch's `Work._get_duration()`): the
// active time of one call, measured where its group was asked to time its calls
// (`ProcessGroup._enable_collectives_timing()`, NCCL's TORCH_NCCL_ENABLE_TIMING).
//
// A CPU call is timed on the host: from when the first of its operations began to run (a
// collective when its group's thread took it up, after the group's earlier calls; a send
// or receive when it was issued: Request::startedAt) to when the call ended, copy-backs
// included. CUDA calls are not timed yet: their works say so. (Timing them as NCCL does,
// by events around what a call queues on its stream, was tried; its GPU check did not
// finish on an H100, cause not found, so it was taken out: docs/perf/cuda_floor_h100.txt.)

#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

#include <string>

#include "loom/request.h"

namespace loom::torch_plugin {

class CallTiming {
 public:
  /// Timed on the host: `requests` are the call's operations (their start times are read
  /// once they have ended).
  explicit CallTiming(c10::ArrayRef<Request> requests)
      : requests_(requests.begin(), requests.end()) {}

  /// The call ended now (its requests have ended and its copy-backs have run).
  void ended();
  /// The call's active time in milliseconds, once ended().
  float millis() const { return duration_; }

 private:
  c10::SmallVector<Request, 1> requests_;  // until ended()
  float duration_ = 0;
};

/// Milliseconds from when the first of `requests` (ended operations) began to run until now.
float millisSinceStart(c10::ArrayRef<Request> requests);

/// The error Work.getDuration() raises for a call made before its group was asked to time
/// its calls.
[[noreturn]] void refuseUntimed(const std::string& what, int rank);

/// The error Work.getDuration() raises for a call on CUDA tensors.
[[noreturn]] void refuseCudaTiming(const std::string& what, int rank);

}  // namespace loom::torch_plugin
