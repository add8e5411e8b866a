#pragma once

// FinishedWork: the c10d::Work of a CPU call whose loom operations had all ended before the
// call returned (a blocking collective runs on its caller's thread, and a fast one queued
// may be done too). Nothing is left to wait for or to call back: the finisher has run, the
// outcome is fixed at construction, and the object is read-only from then on, so wait()
// takes no lock and nothing is allocated beyond the object itself for one output tensor.
// WorkLoom covers everything else (calls still running, CUDA calls with stream semantics).
// Making and destroying a WorkLoom was a third of the plugin's cost of a small blocking
// call (docs/PERFORMANCE.md, "What is left of loom's own part through c10d").

#include <ATen/core/ivalue.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "loom/request.h"
#include "work_loom.h"

namespace loom::torch_plugin {

class FinishedWork : public c10d::Work {
 public:
  /// `requests` have all ended. Unless one failed, runs `finisher` (copy-backs) here; a
  /// failure (a request's or the finisher's) becomes the work's DistBackendError, its
  /// message followed by its group's legend (`ties`). `title` and `inputs` are for the profiler,
  /// `outputs` are what result() and the future return. `timed`: its group times its calls
  /// (GroupTies::timing), and getDuration() answers.
  FinishedWork(int rank, c10d::OpType type, const char* title,
               const std::vector<at::Tensor>& inputs, c10::ArrayRef<at::Tensor> outputs,
               const std::function<void()>& finisher, c10::ArrayRef<Request> requests,
               const GroupTies& ties, bool timed = false);

  bool isCompleted() override { return true; }
  bool isSuccess() const override { return !exception_; }
  std::exception_ptr exception() const override { return exception_; }
  /// The sender, for a receive's work; torch's error for any other (sourceOfReceive).
  int sourceRank() const override;
  std::vector<at::Tensor> result() override { return {outputs_.begin(), outputs_.end()}; }
  /// Returns at once, raising the call's error if it failed.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  /// Nothing to end: the call is over.
  void abort() override {}
  /// A completed future of the outputs (or of the error), made on the first call.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override { return seq_; }
  /// The call's active time in milliseconds (CallTiming); an error if it was not timed.
  float getDuration() const override;
  /// Makes the future hold the outputs as `lists` equal lists (0, the default: one list);
  /// call before the work is shared.
  void setFutureLists(size_t lists) { futureLists_ = lists; }

 private:
  /// The call's name for messages: its title without the "loom:" prefix.
  std::string what() const;
  FinishedWork(int rank, c10d::OpType type, const char* title,
               const std::vector<at::Tensor>& inputs, c10::ArrayRef<at::Tensor> outputs,
               const std::function<void()>& finisher, c10::ArrayRef<Request> requests,
               const GroupTies& ties, bool timed, bool profiling);

  c10::SmallVector<at::Tensor, 1> outputs_;         // one output is the common case: kept inline
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // made by getFuture(), under mutex_
  size_t futureLists_ = 0;
  int source_ = -1;
  uint64_t seq_ = 0;
  const char* title_;    // "loom:<operation>" (a literal)
  float duration_ = -1;  // milliseconds; negative: not timed
};

}  // namespace loom::torch_plugin
