#pragma once

// The execution seam. A communicator runs collectives on host memory itself (its worker
// thread over the shared segment, CommState::execute); operations on an accelerator's
// memory go to a DeviceExecutor, which queues them on the caller's device stream and
// completes their requests when the device has run them. CUDA is the one built today
// (core/cuda_executor.h); another device would be a second implementation, chosen by
// OpOptions::device in CommState::submit.

#include <chrono>
#include <memory>
#include <span>
#include <vector>

#include "algorithms/collective.h"
#include "core/op_state.h"
#include "loom/communicator.h"

namespace loom::detail {

/// One send or receive of device memory; `peer` is a rank of the communicator.
struct Transfer {
  enum class Kind { kSend, kRecv };
  Kind kind;
  int peer;
  int tag;
  void* data;  ///< read for a send, written for a receive
  size_t bytes;
};

class DeviceExecutor {
 public:
  virtual ~DeviceExecutor() = default;
  /// Queues the collective `args` (validated) on `options.stream`, in issue order with this
  /// communicator's other device operations, and completes `state` once the device has
  /// run it (or with the failure). Throws Error for what is refused before queueing.
  virtual void enqueue(const CollectiveArgs& args, const std::shared_ptr<OpState>& state,
                       const OpOptions& options, std::chrono::milliseconds timeout) = 0;
  /// Queues `transfers` (validated; states[i] is transfers[i]'s) on `options.stream` so
  /// that they progress together, like one NCCL group: a send may wait for its receive,
  /// so sends and receives that depend on each other belong in one call. Messages between
  /// two ranks match in the order issued and must agree in tag and size.
  virtual void enqueueTransfers(std::span<const Transfer> transfers,
                                std::span<const std::shared_ptr<OpState>> states,
                                const OpOptions& options, std::chrono::milliseconds timeout) = 0;
};

}  // namespace loom::detail
