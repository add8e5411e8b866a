// Timing a call for Work.getDuration().

#include "call_timing.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>

namespace loom::torch_plugin {

void CallTiming::ended() {
  duration_ = millisSinceStart(requests_);
  requests_.clear();
}

float millisSinceStart(c10::ArrayRef<Request> requests) {
  const auto now = std::chrono::steady_clock::now();
  auto began = now;
  // An operation that ended without running (its communicator shut down first) has no start.
  for (const Request& r : requests) {
    if (r.startedAt() != std::chrono::steady_clock::time_point{}) {
      began = std::min(began, r.startedAt());
    }
  }
  return std::chrono::duration<float, std::milli>(now - began).count();
}

void refuseUntimed(const std::string& what, int rank) {
  TORCH_CHECK(false, "loom: Work.get_duration() of ", what, " on rank ", rank,
              ": the call was not timed; call the group's _enable_collectives_timing() before "
              "issuing the calls to time");
}

void refuseCudaTiming(const std::string& what, int rank) {
  TORCH_CHECK(false, "loom: Work.get_duration() of ", what, " on rank ", rank,
              ": loom times calls on CPU tensors only, not yet calls on CUDA tensors; time "
              "them with CUDA events around the call on your stream, or with torch's profiler");
}

}  // namespace loom::torch_plugin
