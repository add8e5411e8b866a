#pragma once

// The execution seam. A communicator runs collectives on host memory itself (its worker
// thread over the shared segment, CommState::execute); collectives on an accelerator's
// memory go to a DeviceExecutor, which queues them on the caller's device stream and
// completes their requests when the device has run them. CUDA is the one built today
// (core/cuda_executor.h); another device would be a second implementation, chosen by
// OpOptions::device in CommState::submit.

#include <chrono>
#include <memory>

#include "algorithms/collective.h"
#include "core/op_state.h"
#include "loom/communicator.h"

namespace loom::detail {

class DeviceExecutor {
 public:
  virtual ~DeviceExecutor() = default;
  /// Queues the collective `args` (validated) on `options.stream`, in issue order with this
  /// communicator's other device collectives, and completes `state` once the device has
  /// run it (or with the failure). Throws Error for what is refused before queueing.
  virtual void enqueue(const CollectiveArgs& args, const std::shared_ptr<OpState>& state,
                       const OpOptions& options, std::chrono::milliseconds timeout) = 0;
};

}  // namespace loom::detail
