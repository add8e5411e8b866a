// The c10d::Work of a CPU call that was over before it returned.

#include "finished_work.h"

#include <ATen/core/jit_type.h>

#include <string>
#include <string_view>

#include "call_timing.h"
#include "work_loom.h"

namespace loom::torch_plugin {

FinishedWork::FinishedWork(int rank, c10d::OpType type, const char* title,
                           const std::vector<at::Tensor>& inputs, c10::ArrayRef<at::Tensor> outputs,
                           const std::function<void()>& finisher, c10::ArrayRef<Request> requests,
                           const GroupTies& ties, bool timed)
    : FinishedWork(rank, type, title, inputs, outputs, finisher, requests, ties, timed,
                   profilerListens()) {}

FinishedWork::FinishedWork(int rank, c10d::OpType type, const char* title,
                           const std::vector<at::Tensor>& inputs, c10::ArrayRef<at::Tensor> outputs,
                           const std::function<void()>& finisher, c10::ArrayRef<Request> requests,
                           const GroupTies& ties, bool timed, bool profiling)
    : c10d::Work(rank, type, profiling ? title : nullptr, profiledInputs(profiling, inputs)),
      outputs_(outputs.begin(), outputs.end()),
      title_(title) {
  std::exception_ptr failure;
  for (const Request& r : requests) {
    if (r.sourceRank() >= 0) source_ = r.sourceRank();
    if (!failure) failure = r.error();
  }
  if (!requests.empty()) seq_ = requests.back().sequence();
  failure = finishCall(failure, finisher, &ties);
  if (timed) duration_ = millisSinceStart(requests);
  if (profiling) {
    finish(failure);  // also ends the profiler's event for this call
    return;
  }
  // Nobody else can see this work yet: no lock, and no waiter to wake.
  completed_ = true;
  exception_ = failure;
}

bool FinishedWork::wait(std::chrono::milliseconds /*timeout*/) {
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

std::string FinishedWork::what() const {
  const std::string_view title(title_);
  return std::string(title.substr(title.find(':') + 1));
}

int FinishedWork::sourceRank() const {
  return sourceOfReceive(opType_, source_, what(), rank_);
}

float FinishedWork::getDuration() const {
  if (duration_ < 0) {
    refuseUntimed(what(), rank_);
  }
  return duration_;
}

c10::intrusive_ptr<c10::ivalue::Future> FinishedWork::getFuture() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(futureTypeOf(futureLists_));
    if (exception_) {
      future_->setError(exception_);
    } else {
      future_->markCompleted(futureValueOf(outputs_, futureLists_));
    }
  }
  return future_;
}

}  // namespace loom::torch_plugin
