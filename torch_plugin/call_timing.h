#pragma once

// What Work.getDuration() answers for loom's works (torch's `Work._get_duration()`): the
// active time of one call, measured where its group was asked to time its calls
// (`ProcessGroup._enable_collectives_timing()`, NCCL's TORCH_NCCL_ENABLE_TIMING).
//
// A CPU call is timed on the host: from when the first of its operations began to run (a
// collective when its group's thread took it up, after the group's earlier calls; a send
// or receive when it was issued: Request::startedAt) to when the call ended, copy-backs
// included. A CUDA call is timed by the GPU, as NCCL's are: between two timing events on
// its stream, the first recorded once the stream follows the caller's (so the time it
// waits behind the caller's earlier kernels is not counted), the second after everything
// the call queued there.

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
  explicit CallTiming(c10::ArrayRef<Request> requests)
      : requests_(requests.begin(), requests.end()) {}
  /// Timed by the GPU: records the start event on `stream` now, before the call queues
  /// anything there.
  static CallTiming onStream(const c10::Stream& stream);

  /// A GPU-timed call has queued everything on `stream`: records the end event there.
  void queued(const c10::Stream& stream);
  /// A host-timed call ended now (its requests have ended and its copy-backs have run).
  void ended();
  /// Whether the GPU times this call.
  bool onGpu() const { return start_.has_value(); }
  /// The call's active time in milliseconds: a host-timed call's once ended(); a GPU-timed
  /// call's once the GPU has run it, else an error naming `what` on `rank` and what to do.
  float millis(const std::string& what, int rank) const;

 private:
  CallTiming() = default;

  c10::SmallVector<Request, 1> requests_;  // host: until ended()
  float duration_ = 0;                     // host: milliseconds, once ended()
  std::optional<c10::Event> start_;        // GPU: timing events on the call's stream
  std::optional<c10::Event> end_;
};

/// Milliseconds from when the first of `requests` (ended operations) began to run until now.
float millisSinceStart(c10::ArrayRef<Request> requests);

/// The start of Work.getDuration()'s errors, naming the call `what` and `rank`. (Every
/// message is one ready string: see invalid() in tensor_args.cc.)
std::string durationOf(const std::string& what, int rank);

/// The error Work.getDuration() raises for a call made before its group was asked to time
/// its calls.
[[noreturn]] void refuseUntimed(const std::string& what, int rank);

/// The error Work.getDuration() raises for a CUDA send or receive of a coalescing block,
/// whose time is the block's.
[[noreturn]] void refuseHeldTiming(const std::string& what, int rank);

}  // namespace loom::torch_plugin
