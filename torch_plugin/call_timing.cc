// Timing a call for Work.getDuration().

#include "call_timing.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace loom::torch_plugin {

CallTiming CallTiming::onHost(c10::ArrayRef<Request> requests) {
  CallTiming timing;
  timing.requests_.assign(requests.begin(), requests.end());
  return timing;
}

CallTiming CallTiming::onStream(const c10::Stream& stream) {
  CallTiming timing;
  // BACKEND_DEFAULT: an event that records a time (torch's default event does not).
  timing.start_.emplace(stream.device_type(), c10::EventFlag::BACKEND_DEFAULT);
  timing.start_->record(stream);
  return timing;
}

void CallTiming::queued(const c10::Stream& stream) {
  if (!start_) return;
  end_.emplace(stream.device_type(), c10::EventFlag::BACKEND_DEFAULT);
  end_->record(stream);
}

void CallTiming::ended() {
  duration_ = millisSinceStart(requests_);
  requests_.clear();
  hasEnded_ = true;
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

float CallTiming::millis(const std::string& what, int rank) const {
  const std::string call =
      "loom: Work.get_duration() of " + what + " on rank " + std::to_string(rank) + ": ";
  if (start_) {
    TORCH_CHECK(end_.has_value() && end_->query(), call,
                "the GPU has not run the call yet; wait() for it and synchronize its stream "
                "(or call the work's synchronize()) first");
    return static_cast<float>(start_->elapsedTime(*end_));
  }
  TORCH_CHECK(hasEnded_, call, "the call has not ended yet; wait() for it first");
  return duration_;
}

void refuseUntimed(const std::string& what, int rank) {
  TORCH_CHECK(false, "loom: Work.get_duration() of ", what, " on rank ", rank,
              ": the call was not timed; call the group's _enable_collectives_timing() before "
              "issuing the calls to time");
}

}  // namespace loom::torch_plugin
