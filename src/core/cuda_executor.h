#pragma once

// Collectives on CUDA memory among the ranks of one host, as work on the caller's stream
// with no host round trip per step.
//
// Each rank owns a device workspace (cuMem, exported as a file descriptor and mapped by
// every rank of the host): a page of flags, then two slots of two halves (chunk bytes
// each). A collective runs in steps of at most one chunk per rank; step e uses slot e % 2.
// In a step each rank copies its share into its slot, raises its flag to e, makes its
// stream wait until its peers' flags reach e (cuStreamBatchMemOp: the wait is done by the
// GPU's front end, not a spinning kernel, so ranks that share one GPU and are time-sliced
// by it never burn a peer's turn), then reduces or copies out of the peers' slots. A slot
// is refilled only after every peer has said it is done with it ("done" flag >= e - 2).
// Results are bit-identical across ranks: every rank reduces in rank order.
//
// A monitor thread completes requests when their events fire, and enforces deadlines and
// failures: when the communicator fails (a dead rank, a timeout, an abort) it sets the
// abort word the kernels check and raises every flag of every workspace past any epoch, so
// no stream stays blocked on a peer and the GPU is usable afterwards.

#include <cuda.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "core/device_executor.h"
#include "core/failure_domain.h"
#include "core/fd_exchange.h"
#include "cuda/kernels.h"
#include "cuda/shared_memory.h"

namespace loom::detail {

class CudaExecutor final : public DeviceExecutor {
 public:
  /// Joins the host's CUDA workspace exchange (collective over the ranks of this host,
  /// which must be the whole communicator) for buffers on device `device`.
  /// `oneShotBytes`: the largest all_reduce reduced one-shot (unset: 256 KiB, or every size
  /// when the ranks share this GPU).
  CudaExecutor(int device, size_t chunkBytes, std::optional<size_t> oneShotBytes,
               FdExchange exchange, FailureDomain& failures,
               std::chrono::steady_clock::time_point deadline);
  ~CudaExecutor() override;

  void enqueue(const CollectiveArgs& args, const std::shared_ptr<OpState>& state,
               const OpOptions& options, std::chrono::milliseconds timeout) override;

  /// The device ordinal the workspaces live on.
  int device() const { return device_; }

 private:
  enum Flag : int { kReady = 0, kReduced = 1, kDone = 2 };
  struct Pending {
    CUevent event;
    std::shared_ptr<OpState> state;
    std::chrono::steady_clock::time_point deadline;
    std::string op;
  };

  // The steps collectives are made of (on the stream being filled).
  uint64_t beginStep();
  void signal(Flag flag, uint64_t epoch);
  void await(Flag flag, uint64_t epoch, int only = -1);  // every peer, or just `only`
  void copy(const std::vector<cuda::Segment>& segments);
  void reduce(void* dst, std::vector<const void*> srcs, size_t count, const CollectiveArgs& args);
  // Slot addresses: rank q's input half and reduced half of the slot for `epoch`.
  uint8_t* in(int q, uint64_t epoch) const;
  uint8_t* reduced(int q, uint64_t epoch) const;

  void allReduce(const CollectiveArgs& args);
  void reduceToRoot(const CollectiveArgs& args);
  void broadcast(const CollectiveArgs& args);
  void allGather(const CollectiveArgs& args, bool onlyRoot);
  void reduceScatter(const CollectiveArgs& args);
  void allToAll(const CollectiveArgs& args);
  /// An all_to_all with split sizes whose blocks are all one size (the equal form).
  static bool equalBlocks(const CollectiveArgs& args);
  void scatter(const CollectiveArgs& args);
  void barrier();

  void monitor();
  /// Frees every stream waiting on a flag of any workspace and stops the kernels.
  void release();

  const int device_;
  const size_t chunk_;
  const int rank_;
  const int size_;
  FailureDomain& failures_;
  CUcontext context_ = nullptr;
  CUstream abortStream_ = nullptr;
  std::unique_ptr<cuda::Kernels> kernels_;
  std::unique_ptr<cuda::SharedMemory> mine_;
  std::vector<std::unique_ptr<cuda::SharedMemory>> peers_;  // by rank; [rank_] is empty
  std::vector<uint8_t*> bases_;                             // every rank's workspace here
  size_t oneShotBytes_ = 0;

  std::mutex enqueueMutex_;    // one collective is queued at a time
  CUstream stream_ = nullptr;  // the stream being filled (under enqueueMutex_)
  uint64_t epoch_ = 0;         // steps queued so far (under enqueueMutex_)

  std::mutex pendingMutex_;
  std::condition_variable pendingChanged_;
  std::deque<Pending> pending_;  // guarded by pendingMutex_
  bool stopping_ = false;        // guarded by pendingMutex_
  std::atomic<bool> released_{false};
  std::thread monitor_;
};

}  // namespace loom::detail
