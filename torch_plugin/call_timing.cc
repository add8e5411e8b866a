// Timing a call for Work.getDuration().

#include "call_timing.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>

namespace loom::torch_plugin {

CallTiming CallTiming::onStream(const c10::Stream& stream) {
  CallTiming timing;
  // BACKEND_DEFAULT: an event that records a time (torch's default one does not).
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
  if (!start_) return duration_;
  // query() first: elapsedTime() of an event the GPU has not reached raises CUDA's
  // "device not ready", which names neither the call nor what to do.
  TORCH_CHECK(end_.has_value() && end_->query(),
              durationOf(what, rank) +
                  "the GPU has not run the call yet; call the work's synchronize() (or wait() "
                  "and synchronize the stream) first");
  return static_cast<float>(start_->elapsedTime(*end_));
}

std::string durationOf(const std::string& what, int rank) {
  return "loom: Work.get_duration() of " + what + " on rank " + std::to_string(rank) + ": ";
}

void refuseUntimed(const std::string& what, int rank) {
  TORCH_CHECK(false, durationOf(what, rank) +
                         "the call was not timed; call the group's _enable_collectives_timing() "
                         "before issuing the calls to time");
}

void refuseHeldTiming(const std::string& what, int rank) {
  TORCH_CHECK(false, durationOf(what, rank) +
                         "a CUDA send or receive inside a coalescing block runs with the whole "
                         "block; ask the block's work (the one batch_isend_irecv or the "
                         "coalescing manager returns) for its duration");
}

}  // namespace loom::torch_plugin
