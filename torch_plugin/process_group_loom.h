#pragma once

// ProcessGroupLoom: the c10d::Backend named "loom", over a loom::Communicator. Every call
// checks its tensors and options (bad input is a RuntimeError before anything is sent),
// stages what loom cannot use directly, issues the operation on the communicator (a
// blocking CPU call runs on the caller's thread, others off it, in issue order) and returns
// a WorkLoom, or a FinishedWork for a CPU call that is over by then. Failures while running
// surface from Work.wait() and the future as DistBackendError.
//
// CUDA tensors take the same entries: cudaStreamFor() picks the stream a call runs on, and
// WorkLoom gives its work NCCL's stream semantics.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "loom/communicator.h"
#include "tensor_args.h"
#include "tensor_bytes.h"
#include "work_loom.h"

namespace loom::torch_plugin {

/// The operator a call of the direct entry (direct_ops.cc) names while it takes its group's
/// c10d path on this thread, so that the path's messages name what the caller called; null
/// otherwise.
inline thread_local const char* tDirectOp = nullptr;

/// This process's rank in its world loom group, or -1 while there is none (for messages
/// about a call that names no group of loom's).
int worldRank();

class ProcessGroupLoom : public c10d::Backend, private EarlierCalls {
 public:
  struct Options : c10d::Backend::Options {
    explicit Options(std::chrono::milliseconds timeout = kBackendDefaultTimeout)
        : c10d::Backend::Options("loom", timeout) {}
  };

  /// Who asks for a group made through a store.
  enum class Maker {
    kUser,   // built directly (as vLLM builds its stateless groups): a group of its own
    kTorch,  // torch's backend factory: its world is what later groups over its ranks derive from
  };
  /// Joins a new communicator through `store` (rank and size within the group), or, for
  /// torch's groups over ranks of its loom world, derives it from that world.
  ProcessGroupLoom(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   c10::intrusive_ptr<Options> options, Maker maker);
  /// Wraps a communicator derived from another group's (split).
  ProcessGroupLoom(std::shared_ptr<Communicator> comm, c10::intrusive_ptr<Options> options);
  ~ProcessGroupLoom() override;
  /// The last strong reference is gone while a weak one remains (the parent's record of its
  /// last split or merge): the communicator goes now, not when that record does.
  void release_resources() override;

  const std::string getBackendName() const override { return "loom"; }
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override { return options_; }
  bool supportsSplitting() const override { return true; }
  bool supportsShrinking() const override { return true; }
  bool supportsCoalescing() const override { return true; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  /// Times the calls made from now on, for Work.getDuration() (CallTiming), as NCCL does
  /// under TORCH_NCCL_ENABLE_TIMING.
  void enableCollectivesTiming() override { ties_->timing.store(true, std::memory_order_relaxed); }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return comm_->lastSequence(); }
  /// split_group: a child over `ranks` (of this group), nullptr where this rank is not one.
  /// torch asks once per device type of this group with the same store; this one backend
  /// serves them all, so a second ask for the same split returns the child the first made.
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
      const c10::intrusive_ptr<c10d::Backend::Options>& opts) override;
  /// dist.shrink_group: the ranks that remain rebuild without `ranksToExclude` (dead ones,
  /// typically), even after this group failed. SHRINK_ABORT (1) aborts this group first.
  c10::intrusive_ptr<c10d::Backend> shrink(
      const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
      const c10::intrusive_ptr<c10d::Backend::Options>& optsOverride) override;
  /// ProcessGroup.merge_remote_group: a new group of `size` ranks, this process `rank` of
  /// them, joined through `store` (processes of groups made apart, as Gloo's merge). torch
  /// asks once per device type of this group; this one backend serves them all, so a second
  /// ask for the same join returns the group the first made.
  c10::intrusive_ptr<c10d::Backend> merge(const c10::intrusive_ptr<c10d::Store>& store,
                                          const c10::intrusive_ptr<c10d::Backend::Options>& opts,
                                          const int& rank, const int& size) override;
  void abort() override;
  void shutdown() override;
  /// shutdown() of the group of `comm` and `ties` (the exit handler's, exit_shutdown.h).
  static void shutdownGroup(const std::shared_ptr<Communicator>& comm, const GroupTies& ties);
  /// init_process_group(device_id=cuda:N): sets up the CUDA workspaces now, with every rank
  /// (so a first send/recv between two ranks need not wait for the others).
  void eagerConnectSingleDevice(at::Device device) override;
  /// True for device index -1: CPU, whose memory allocateTensor lends (and a device given
  /// without an index, such as a bare "cuda", which torch cannot tell from CPU here).
  bool supportsTensorAlloc(c10::DeviceIndex deviceIdx) override { return deviceIdx < 0; }
  /// A 1-D CPU tensor of `size` elements from loom's lending pool (what FSDP2's
  /// set_allocate_memory_from_process_group_for_comm asks for): large all_gathers and
  /// reduce_scatters whose inputs all live there read them in place, skipping the copy
  /// into loom's shared slots. On other devices a plain allocation (nothing is lent there).
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  /// Runs the send or receive `f`; inside a coalescing block (batch_isend_irecv) its error
  /// is held for endCoalescing to raise, and its work fails with it. Raised at once, it would
  /// leave torch's coalescing manager open (it ends the block only when its body returns),
  /// and torch would then queue every later collective of the group and never run it.
  template <class F>
  c10::intrusive_ptr<c10d::Work> heldInBlock(c10d::OpType type, F&& f);
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;

  /// The communicator underneath (tests, the Python side and torch.ops.loom use it).
  Communicator& communicator() { return *comm_; }
  /// What this group's error messages end with (GroupTies::legend; empty for the world).
  const GroupTies& ties() const { return *ties_; }
  /// Whether a coalescing block is open (startCoalescing without its endCoalescing).
  bool isCoalescing() const { return coalescing_.load(std::memory_order_acquire); }
  /// A call of the direct entry (torch.ops.loom) starts on this group: what site() does for
  /// a c10d call, so that a copy it takes at issue waits for this group's earlier calls.
  CallSite directSite(const char* op) const { return site(op, /*blocking=*/true); }
  /// The options of a blocking call of the direct entry (torch.ops.loom): under desync debug
  /// with the signature its c10d fallback (same `type`, inputs and outputs) carries, so that
  /// ranks that took different paths for the same call still agree.
  OpOptions directOptions(c10d::OpType type, const std::vector<at::Tensor>& inputs,
                          const std::vector<at::Tensor>& outputs) const {
    OpOptions o;
    o.blocking = true;
    if (desyncDebug_) o.signature = signatureOf(type, inputs, outputs);
    return o;
  }

 private:
  /// The global rank of this group's rank `r` (the world's numbering where the group is
  /// numbered as the world is), for a child's global_ranks_in_group.
  uint64_t globalRankOf(int r) const;
  /// Runs `issue` (which queues loom operations) and wraps its requests in a WorkLoom (a
  /// FinishedWork for a CPU call whose requests have all ended by then); loom's argument
  /// errors become RuntimeError, its other errors DistBackendError.
  /// `outputs` (a std::vector<at::Tensor>, moved or copied; braced lists make one) are what
  /// the work returns; its future holds them as `futureLists` equal lists (0: one list).
  template <class OutputList = std::vector<at::Tensor>, class Issue>
  c10::intrusive_ptr<c10d::Work> launch(const CallSite& site, c10d::OpType type, const char* title,
                                        const std::vector<at::Tensor>& inputs, OutputList&& outputs,
                                        std::function<void()> finisher, Issue&& issue,
                                        size_t futureLists = 0);
  c10::intrusive_ptr<c10d::Work> allreduceSparse(std::vector<at::Tensor>& tensors,
                                                 const c10d::AllreduceOptions& opts);
  c10::intrusive_ptr<c10d::Work> receive(std::vector<at::Tensor>& tensors, int srcRank, int tag,
                                         const char* title);
  OpOptions opOptions(std::chrono::milliseconds timeout, bool blocking = false) const;
  /// For a call on CUDA tensors: checks they are all on one GPU and returns the stream the
  /// call runs on: the caller's current stream for a blocking call outside a coalescing
  /// block, else the group's loom stream, made to wait for the caller's current stream.
  /// nullopt for CPU tensors; mixing devices is an error.
  std::optional<c10::Stream> cudaStreamFor(const CallSite& site,
                                           const std::vector<at::Tensor>& inputs,
                                           const std::vector<at::Tensor>& outputs);
  /// A call on `stream` was queued: the group has GPU work on its device, and if it is the
  /// loom stream, its device is the group's.
  void acceptedOn(const c10::Stream& stream);
  /// barrier(): the GPU whose work a barrier settles (the one the group's last accepted
  /// CUDA call ran on), nullopt for a group that has run none.
  std::optional<c10::Device> barrierGpu() const;
  /// Blocks (without the GIL) until this rank's GPU work on `device` for this group has run:
  /// the caller's current stream and the group's loom stream (nothing while the current
  /// stream is captured into a CUDA graph).
  void settleGpuWork(c10::Device device);
  /// After a refused call or coalescing block, which returns no work whose wait() would do
  /// it: makes the caller's current stream wait for `stream` (the loom stream where what was
  /// issued before the refusal runs), so the caller's next kernels come after it and a CUDA
  /// graph capture can still end; nothing without a stream or for the current one. A join
  /// an invalidated capture refuses is dropped: the loom error is the one to report.
  static void rejoinRefused(const std::optional<c10::Stream>& stream) noexcept;
  /// After a call was refused part way (an operation after the first failed to issue):
  /// keeps what the operations issued so far use (`uses` and `outputs`, what `finisher`
  /// holds) alive until they end, without running `finisher`; CUDA tensors are also marked
  /// in use on `stream` for the caching allocator. The refused call's outputs are undefined.
  static void abandonIssued(const std::optional<c10::Stream>& stream,
                            const std::vector<at::Tensor>& uses,
                            const std::vector<at::Tensor>& outputs, std::function<void()> finisher,
                            c10::ArrayRef<Request> requests);
  /// After a CUDA call's collectives are queued: runs `finisher` (copy-backs) on `stream`,
  /// tells the caching allocator the tensors are in use there (`uses`: the caller's inputs
  /// and the staged copies; and `outputs`), and keeps what `finisher` holds alive until the
  /// GPU has run the call's last request.
  static void finishOnStream(const c10::Stream& stream, const std::vector<at::Tensor>& uses,
                             const std::vector<at::Tensor>& outputs,
                             const std::function<void()>& finisher,
                             c10::ArrayRef<Request> requests);
  /// Desync debug: the tensor shapes of a call that must agree across ranks, or "".
  std::string signatureOf(c10d::OpType type, const std::vector<at::Tensor>& inputs,
                          const std::vector<at::Tensor>& outputs) const;
  CallSite site(const char* op, bool blocking = false) const {
    discardStaged();  // a call refused before its launch() left its copies noted
    prepareCallOf(this);
    return CallSite{tDirectOp != nullptr ? tDirectOp : op, rank_, size_, blocking, &ties_->legend};
  }
  /// EarlierCalls: waits for the pendingWrites_ of `read`'s storage.
  void settle(const at::Tensor& read) const override;
  /// Notes what `work`, an asynchronous call on CPU tensors, writes (its outputs; a send
  /// writes nothing), until it ends.
  void noteAsync(const c10::intrusive_ptr<c10d::Work>& work, c10d::OpType type);
  // Lets go of the open block's calls that ended well, once it has doubled since it last
  // looked; with coalesceMutex_ held.
  void forgetEndedInBlock();

  std::shared_ptr<Communicator> comm_;
  c10::intrusive_ptr<Options> options_;
  const bool desyncDebug_;  // LOOM_DESYNC_DEBUG=1 or TORCH_DISTRIBUTED_DEBUG=DETAIL
  // noteAsync's: the storage each asynchronous CPU call still running writes, the bytes of
  // it that it writes, and its work.
  struct PendingWrite {
    const void* storage;
    TensorBytes bytes;
    c10::weak_intrusive_ptr<c10d::Work> work;
  };
  mutable std::mutex pendingWritesMutex_;
  std::vector<PendingWrite> pendingWrites_;  // guarded by pendingWritesMutex_

  // Coalescing: requests issued between startCoalescing and endCoalescing (a loom group:
  // CUDA sends and receives are held until endCoalescing, and so are their copy-backs).
  struct HeldFinish {
    c10::Stream stream;
    std::vector<at::Tensor> uses;  // the caller's inputs and the copies staged for them
    std::vector<at::Tensor> outputs;
    std::function<void()> finisher;
    Requests requests;
    std::shared_ptr<HeldEnd> end;  // marked once the call and its copy-back are queued
  };
  /// endCoalescing, once the block's held CUDA sends and receives and their copy-backs are
  /// queued: marks where each ends (HeldEnd), for its own work's wait().
  void markHeldEnds(std::vector<HeldFinish>& held);

  // The last merge: its store (held, so that no later store takes its address), rank and
  // size, and the group it made, not kept alive by this record (merge()).
  struct LastMerge {
    c10::intrusive_ptr<c10d::Store> store;
    int rank = -1;
    int size = -1;
    std::optional<c10::weak_intrusive_ptr<c10d::Backend>> merged;
  };
  // The last split: the store torch passed (held, so that no later store takes its
  // address), the ranks, and the child, not kept alive by this record (split()).
  struct LastSplit {
    c10::intrusive_ptr<c10d::Store> store;
    std::vector<int> ranks;
    std::optional<c10::weak_intrusive_ptr<c10d::Backend>> child;
  };
  std::mutex derivedMutex_;
  LastMerge lastMerge_;  // guarded by derivedMutex_
  LastSplit lastSplit_;  // guarded by derivedMutex_
  std::mutex coalesceMutex_;
  std::atomic<bool> coalescing_{false};  // written under coalesceMutex_; launch() peeks
  std::vector<Request> coalesced_;
  std::vector<HeldFinish> held_;  // guarded by coalesceMutex_
  // The block's CPU calls that copy results back when they end (staged or packed tensors):
  // the block's work ends after them, not with their requests. Guarded by coalesceMutex_.
  std::vector<c10::intrusive_ptr<WorkLoom>> copyingBack_;
  // The first error of a send or receive inside the block, which endCoalescing raises
  // (heldInBlock()); guarded by coalesceMutex_.
  std::exception_ptr blockError_;
  std::optional<c10::Stream> coalescedStream_;  // a CUDA call's, if any; coalesceMutex_
  std::optional<CallTiming> blockTiming_;       // a timed CUDA block's; coalesceMutex_
  // The block's size at which forgetEndedInBlock() next looks; guarded by coalesceMutex_.
  size_t blockPruneAt_ = kBlockPruneFloor;
  static constexpr size_t kBlockPruneFloor = 8;

  std::mutex streamMutex_;
  std::optional<c10::Stream> loomStream_;  // CUDA calls' stream (one GPU per rank); streamMutex_
  // A call queued on loomStream_ was accepted, so its device is the group's; streamMutex_
  // (read first without it: set once, never cleared).
  std::atomic<bool> loomStreamAccepted_{false};
  std::atomic<int> lastGpu_{-1};  // the GPU of its latest accepted CUDA call (-1: none yet)
  const std::shared_ptr<EventPool> events_ = std::make_shared<EventPool>();  // CUDA works' ends
  // What this group's works share with it (its legend is set once, in the constructor).
  const std::shared_ptr<GroupTies> ties_ = std::make_shared<GroupTies>();
};

}  // namespace loom::torch_plugin
