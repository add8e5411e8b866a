#pragma once

// What Work.getDuration() answers for loom's works (torch's `Work._get_duration()`): the
// active time of one call, measured where its group was asked to time its calls
// (`ProcessGroup._enable_collectives_timing()`, NCCL's TORCH_NCCL_ENABLE_TIMING).
//
// A CPU call is timed on the host: from when the first of its operations began to run (a
// collective when its group's thread took it up, after the group's earlier calls; a send
// or receive when it was issued: Request::startedAt) to when the call ended, copy-backs
// included. A CUDA call is timed by the GPU, as NCCL's are: between two timing events
// recorded on its stream around everything it queued there, so the time it waited behind
// earlier kernels on that stream is not counted.

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

#include <optional>
#include <string>

#include "loom/request.h"

namespace loom::torch_plugin {

class CallTiming {
 public:
  /// Timed on the host: `requests` are the call's operations (their start times are read
  /// once they have ended).
  static CallTiming onHost(c10::ArrayRef<Request> requests);
  /// Timed by the GPU: records the start event on `stream` now, before the call queues
  /// anything there.
  static CallTiming onStream(const c10::Stream& stream);

  /// A GPU-timed call has queued everything on `stream`: records the end event there.
  void queued(const c10::Stream& stream);
  /// A host-timed call ended now (its requests have ended and its copy-backs have run).
  void ended();
  /// Whether the GPU times this call.
  bool onGpu() const { return start_.has_value(); }
  /// The call's active time in milliseconds. `what` and `rank` name the call in the error
  /// raised while the time is not known yet (a host-timed call not ended, or a GPU that
  /// has not run the call yet).
  float millis(const std::string& what, int rank) const;

 private:
  CallTiming() = default;

  c10::SmallVector<Request, 1> requests_;  // host: until ended()
  float duration_ = 0;                     // host: milliseconds, once ended()
  bool hasEnded_ = false;
  std::optional<c10::Event> start_;  // GPU: timing events, recorded on the call's stream
  std::optional<c10::Event> end_;
};

/// Milliseconds from when the first of `requests` (ended operations) began to run until now.
float millisSinceStart(c10::ArrayRef<Request> requests);

/// The error Work.getDuration() raises for a call made before its group was asked to time
/// its calls.
[[noreturn]] void refuseUntimed(const std::string& what, int rank);

}  // namespace loom::torch_plugin
