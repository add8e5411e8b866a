// CUDA collectives among the ranks of one host: see cuda_executor.h. This file: the
// workspace, flags, agreement and launches, queueing, failure handling; the fused kernels'
// launches are in cuda_fused.cc, the collectives and transfers as steps in
// cuda_collectives.cc, and what descriptors say in cuda_descriptors.cc.

#include "core/cuda_executor.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <climits>
#include <cstdio>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "core/cuda_descriptors.h"
#include "core/cuda_fused_trace.h"
#include "core/cuda_settings.h"
#include "core/cuda_steps.h"
#include "core/cuda_workspace.h"
#include "core/flight_recorder.h"
#include "cuda/driver.h"
#include "loom/error.h"
#include "util/deadline.h"
#include "util/posix.h"
#include "util/trace.h"

namespace loom::detail {

namespace {

using Clock = std::chrono::steady_clock;
using cuda::check;
using cuda::Driver;

// How long the destructor waits for failed calls to leave the GPU before it gives up on
// their workspaces (kept mapped, not freed: a kernel still reading them must not fault).
constexpr auto kDrainBound = std::chrono::seconds(30);
// Tells the user, once per process and from the host's first rank, that ranks sharing a GPU
// without MPS take turns on it: every CUDA call then costs a switch between processes, which
// a user can remove without changing the job.
void hintMps(int crowd) {
  static std::once_flag once;
  std::call_once(once, [crowd] {
    std::fprintf(stderr,
                 "loom: %d ranks share one GPU without NVIDIA's MPS, so the GPU runs their "
                 "processes in turns and a CUDA collective of up to 2 MiB takes 150-560 us "
                 "(one H200, 2-4 ranks); MPS, started before the job, runs them side by side, "
                 "3-13x faster (README.md, \"Using loom from PyTorch\")\n",
                 crowd);
  });
}

}  // namespace

CudaExecutor::CudaExecutor(int device, const CudaTuning& tuning, FdExchange exchange,
                           FailureDomain& failures, Clock::time_point deadline)
    : device_(device),
      chunk_(tuning.chunkBytes),
      rank_(exchange.localRank),
      size_(exchange.localSize),
      failures_(failures),
      layout_(workspaceLayout(chunk_, exchange.localSize)),
      eager_(0, kOddFlagsOffset, kDescOffset, layout_.eagerSlots, kPairOffset,
             layout_.eagerMailboxes, layout_.eagerMailSlot, false, exchange.localSize),
      graph_(kGraphOffset, kGraphOddFlagsOffset, kGraphDescOffset, layout_.graphSlots,
             kGraphPairOffset, layout_.graphMailboxes, layout_.graphMailSlot, true,
             exchange.localSize),
      issuedSent_(static_cast<size_t>(exchange.localSize)),
      issuedTaken_(static_cast<size_t>(exchange.localSize)),
      finishedSent_(static_cast<size_t>(exchange.localSize)),
      finishedTaken_(static_cast<size_t>(exchange.localSize)) {
  // Until this rank offers its workspace, a failure here (no driver, no memory, ...) is
  // told to the host's other ranks, which would otherwise wait in the exchange for its offer
  // until the deadline. Once it has offered, a failure of this rank (a peer gone mid-way, a
  // peer's workspace it cannot map) fails the communicator: other ranks may hold every
  // workspace and would wait for this rank in their first CUDA collective. A refusal by
  // another rank reaches every rank alike, and none holds a workspace then.
  bool offered = false;
  auto giveUp = [&](ErrorCode code, const std::string& why) {
    if (!offered) {
      refuseFds(exchange, why, deadline);
      return;
    }
    failures.fail(code, exchange.rank,
                  "rank " + std::to_string(exchange.rank) +
                      " could not set up its CUDA workspaces while the host's ranks shared "
                      "them: " +
                      why);
  };
  try {
    const Driver& d = Driver::get();
    const std::string& op = exchange.op;
    if (size_ > cuda::kMaxSources) {
      throw Error(ErrorCode::kUnsupported, op, exchange.rank,
                  "CUDA collectives take at most " + std::to_string(cuda::kMaxSources) +
                      " ranks per host; this communicator has " + std::to_string(size_));
    }
    // The first CUDA call of a group may come while its stream captures a graph: setting up
    // is loom's own business, not the capture's.
    cuda::RelaxedCaptureGuard relaxed;
    CUdevice dev = 0;
    check(d.cuDeviceGet(&dev, device), op, exchange.rank, "cuDeviceGet");
    check(d.cuDevicePrimaryCtxRetain(&context_, dev), op, exchange.rank,
          "cuDevicePrimaryCtxRetain");
    cuda::ContextGuard guard(context_);
    try {
      check(d.cuStreamCreate(&abortStream_, CU_STREAM_NON_BLOCKING), op, exchange.rank,
            "cuStreamCreate");
      check(d.cuStreamCreate(&side_, CU_STREAM_NON_BLOCKING), op, exchange.rank, "cuStreamCreate");
      // The eager lane's last end is its last call's own event (queue()); the graph lane
      // records one of its own (an event recorded in a capture is not a call's to monitor).
      for (CUevent* event : {&graph_.lastEnd, &forked_, &joined_}) {
        check(d.cuEventCreate(event, CU_EVENT_DISABLE_TIMING), op, exchange.rank, "cuEventCreate");
      }
      kernels_ = std::make_unique<cuda::Kernels>();
      void* report = nullptr;
      check(d.cuMemHostAlloc(&report, sizeof(cuda::MismatchReport),
                             CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE),
            op, exchange.rank, "cuMemHostAlloc");
      reportHost_ = new (report) cuda::MismatchReport{};
      CUdeviceptr reportDevice = 0;
      check(d.cuMemHostGetDevicePointer(&reportDevice, report, 0), op, exchange.rank,
            "cuMemHostGetDevicePointer");
      report_ = reinterpret_cast<cuda::MismatchReport*>(reportDevice);
      mine_ = cuda::SharedMemory::allocate(dev, layout_.bytes);
      posix::Fd exported = mine_->exportFd();
      offered = true;
      // Whether this process's contexts go through NVIDIA's MPS, whose clients' kernels run
      // side by side on a GPU they share instead of taking turns: told with the workspace, so
      // every rank reads the same answer for all. A driver too old to know the attribute
      // answers with an error: taken as no MPS, the paths chosen before loom asked.
      int mpsClient = 0;
      if (d.cuDeviceGetAttribute(&mpsClient, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, dev) !=
          CUDA_SUCCESS) {
        mpsClient = 0;
      }
      const std::vector<FdOffer> offers = exchangeFds(
          exchange, exported.get(),
          cudaSettingsNote(tuning, mpsClient != 0, kernels_->residentFusedBlocks()), deadline);
      std::vector<std::string> notes;
      for (const FdOffer& o : offers) notes.push_back(o.note);
      // Every rank holds every note, so all refuse alike, before any uses a peer's workspace:
      // the communicator lives on (its CPU collectives too); only its CUDA path is refused,
      // naming the rank that differs.
      if (const auto differ = cudaSettingsDisagree(notes)) {
        throw ExchangeRefused(ErrorCode::kInvalidArgument, op, exchange.rank, *differ);
      }
      const bool everyRankUnderMps = std::all_of(notes.begin(), notes.end(), notesMpsClient);
      std::vector<int> devices(static_cast<size_t>(size_), device);  // by rank
      peers_.resize(static_cast<size_t>(size_));
      bases_.resize(static_cast<size_t>(size_));
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) {
          bases_[q] = reinterpret_cast<uint8_t*>(mine_->address());
          continue;
        }
        peers_[q] = cuda::SharedMemory::open(offers[q].fd.get(), mine_->bytes(), dev);
        bases_[q] = reinterpret_cast<uint8_t*>(peers_[q]->address());
        check(d.cuPointerGetAttribute(&devices[q], CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                      peers_[q]->address()),
              op, exchange.rank, "cuPointerGetAttribute");
      }
      // Every rank sees every workspace's device, every rank's MPS state and the least
      // resident fused blocks of every rank's GPU (GPU models differ), so all reach the same
      // paths: ranks that chose apart would wait in kernels their peers do not run.
      int leastResident = INT_MAX;
      for (const std::string& note : notes) {
        leastResident = std::min(leastResident, notesResidentFusedBlocks(note));
      }
      paths_ = chooseCudaPaths(tuning, devices, everyRankUnderMps, leastResident,
                               cuda::fusedFitsIn(leastResident));
      if (paths_.takingTurns && exchange.localRank == 0) hintMps(paths_.crowd);
      // A fused transfer's blocks each move at least 32 KiB of a chunk (64 of 128 KiB by
      // default); how many a call runs per stream is its own (fusedTransfer).
      transferMostBlocks_ = static_cast<int>(std::bit_floor(
          std::clamp<size_t>(eager_.mailSlot / (32 << 10), 1, cuda::kTransferPieces)));
      fusedTwoShotBytes_ = tuning.fusedTwoShotBytes;
      fusedTwoShotBroadcastBytes_ = tuning.fusedTwoShotBroadcastBytes;
      fusedChainBroadcastBytes_ = tuning.fusedChainBroadcastBytes;
      fusedRingAllReduceBytes_ = tuning.fusedRingAllReduceBytes;
      if (!tuning.fusedTrace.empty() && paths_.fused) {
        trace_ = std::make_unique<CudaFusedTrace>(tuning.fusedTrace, exchange.rank);
      }
    } catch (...) {
      // A peer gone during the exchange, no memory, ...: give back what was taken so far (the
      // destructor does not run for an object whose constructor threw).
      peers_.clear();
      mine_.reset();
      kernels_.reset();
      if (reportHost_ != nullptr) d.cuMemFreeHost(reportHost_);
      for (CUevent event : {graph_.lastEnd, forked_, joined_}) {
        if (event != nullptr) d.cuEventDestroy(event);
      }
      if (side_ != nullptr) d.cuStreamDestroy(side_);
      if (abortStream_ != nullptr) d.cuStreamDestroy(abortStream_);
      d.cuDevicePrimaryCtxRelease(dev);
      throw;
    }
  } catch (const ExchangeRefused&) {
    throw;
  } catch (const Error& e) {
    giveUp(e.code(), e.detail());
    throw;
  } catch (const std::exception& e) {
    giveUp(ErrorCode::kSystem, e.what());
    throw;
  }
  monitor_ = std::thread([this] {
    posix::nameThisThread("loom-cuda-mon");
    detail::markCompleting(this);  // the calls' completion callbacks run here
    monitor();
  });
}

CudaExecutor::~CudaExecutor() {
  const Driver& d = Driver::get();
  bool drained = true;
  {
    std::unique_lock<std::mutex> lock(pendingMutex_);
    // Let queued collectives finish (peers are still running them); release them if the
    // communicator has failed meanwhile (the monitor does). Failed ones leave the GPU
    // (draining_) soon after, released; a GPU that keeps them longer than kDrainBound
    // keeps the workspaces too.
    pendingChanged_.wait(lock, [this] { return pending_.empty(); });
    drained = pendingChanged_.wait_for(lock, kDrainBound, [this] { return draining_.empty(); });
  }
  {
    cuda::ContextGuard guard(context_);
    // Replays of captured calls may still be running on the workspaces about to be unmapped
    // (released already, and again by the monitor, if the communicator failed); the
    // caller's graphs must not be replayed after this.
    if (graphsCaptured_ && drained) d.cuCtxSynchronize();
  }
  {
    std::lock_guard<std::mutex> lock(pendingMutex_);
    stopping_ = true;
  }
  pendingChanged_.notify_all();
  monitor_.join();
  cuda::ContextGuard guard(context_);
  if (!drained) {
    std::fprintf(stderr,
                 "loom: rank %d: failed CUDA calls were still on the GPU %lld s after the "
                 "communicator was destroyed; its CUDA workspaces stay mapped until the "
                 "process exits\n",
                 rank_, static_cast<long long>(kDrainBound.count()));
    (void)mine_.release();
    for (auto& peer : peers_) (void)peer.release();
    (void)kernels_.release();  // their module too (and the mismatch report's host memory)
    return;
  }
  leaveFinalCounts();
  d.cuStreamSynchronize(abortStream_);
  d.cuStreamDestroy(abortStream_);
  d.cuStreamSynchronize(side_);
  d.cuStreamDestroy(side_);
  for (CUevent event : {graph_.lastEnd, forked_, joined_}) d.cuEventDestroy(event);
  for (CUevent event : spareEvents_) d.cuEventDestroy(event);  // eager_.lastEnd among them
  if (trace_) trace_->write();  // every call has finished (pending_ is empty)
  trace_.reset();
  peers_.clear();
  mine_.reset();
  kernels_.reset();
  d.cuMemFreeHost(reportHost_);
  CUdevice dev = 0;
  d.cuDeviceGet(&dev, device_);
  d.cuDevicePrimaryCtxRelease(dev);
}

uint8_t* CudaExecutor::flag(int q, Flag which, uint64_t epoch) const {
  return bases_[q] + (epoch % 2 ? lane_->oddFlagsAt : lane_->flagsAt) + which * kFlagStride;
}

void CudaExecutor::fork() {
  const Driver& d = Driver::get();
  check(d.cuEventRecord(forked_, stream_), "cuda", rank_, "cuEventRecord");
  check(d.cuStreamWaitEvent(side_, forked_, 0), "cuda", rank_, "cuStreamWaitEvent");
}

void CudaExecutor::join() {
  const Driver& d = Driver::get();
  check(d.cuEventRecord(joined_, side_), "cuda", rank_, "cuEventRecord");
  check(d.cuStreamWaitEvent(stream_, joined_, 0), "cuda", rank_, "cuStreamWaitEvent");
}

void CudaExecutor::joinAfterFailure() noexcept {
  try {
    join();
  } catch (...) {  // the driver's own error, already failing the call, is the one that matters
  }
}

uint8_t* CudaExecutor::in(int q, uint64_t epoch) const {
  return bases_[q] + lane_->slotsAt + (epoch % 2) * 2 * chunk_;
}

uint8_t* CudaExecutor::reduced(int q, uint64_t epoch) const {
  return in(q, epoch) + chunk_;
}

uint8_t* CudaExecutor::pair(int owner, int peer) const {
  return bases_[owner] + lane_->pairsAt + static_cast<size_t>(peer) * kPairStride;
}

uint8_t* CudaExecutor::mailbox(int receiver, int sender, uint64_t chunk) const {
  return bases_[receiver] + lane_->mailboxesAt +
         (static_cast<size_t>(sender) * 2 + chunk % 2) * lane_->mailSlot;
}

uint64_t* CudaExecutor::epochBase() const {
  if (!lane_->onDevice) return nullptr;
  return reinterpret_cast<uint64_t*>(bases_[rank_] + kDeviceEpochOffset);
}

uint64_t* CudaExecutor::sentBase(int peer) const {
  if (!lane_->onDevice) return nullptr;
  return reinterpret_cast<uint64_t*>(bases_[rank_] + kGraphCountsOffset +
                                     static_cast<size_t>(peer) * 16);
}

uint64_t* CudaExecutor::takenBase(int peer) const {
  if (!lane_->onDevice) return nullptr;
  return sentBase(peer) + 1;
}

uint64_t CudaExecutor::beginStep() {
  const uint64_t e = ++lane_->epoch;
  // Slot e % 2 was last used in step e - 2: wait until every peer is done reading it. (In
  // the graph lane e counts from the device epoch, and e - 2 may be a step of an earlier
  // captured call.)
  if (lane_->onDevice || e > 2) await(kDone, e - 2);
  return e;
}

void CudaExecutor::queueFlagSteps(std::span<const FlagStep> steps,
                                  std::span<const cuda::Advance> advances) {
  if (steps.size() > cuda::kMaxSources || advances.size() > 2 * cuda::kMaxSources + 1 ||
      (!advances.empty() && !lane_->onDevice)) {
    throw Error(ErrorCode::kInternal, "cuda", rank_, "a batch of flag steps out of bounds");
  }
  if (!lane_->onDevice) {
    if (steps.empty()) return;
    std::array<CUstreamBatchMemOpParams, cuda::kMaxSources> ops{};
    size_t n = 0;
    for (const FlagStep& f : steps) {
      CUstreamBatchMemOpParams& p = ops[n++];
      if (f.wait) {
        p.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
        p.waitValue.address = reinterpret_cast<CUdeviceptr>(f.flag);
        p.waitValue.value64 = f.offset;
        p.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
      } else {
        // The default write is ordered after all earlier work on the stream, with a fence.
        p.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
        p.writeValue.address = reinterpret_cast<CUdeviceptr>(f.flag);
        p.writeValue.value64 = f.offset;
        p.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
      }
    }
    check(Driver::get().cuStreamBatchMemOp(stream_, static_cast<unsigned>(n), ops.data(), 0),
          "cuda", rank_, "cuStreamBatchMemOp");
    return;
  }
  if (steps.empty() && advances.empty()) return;
  cuda::FlagParams params{};
  for (const FlagStep& f : steps) {
    params.ops[params.count++] = {reinterpret_cast<uint64_t*>(f.flag), f.base, f.offset, f.wait};
  }
  for (const cuda::Advance& a : advances) params.advances[params.nadvance++] = a;
  params.abort = reinterpret_cast<const volatile uint64_t*>(bases_[rank_] + kAbortOffset);
  params.waiting = reinterpret_cast<volatile uint64_t*>(bases_[rank_] + kGraphWaitOffset);
  kernels_->flags(stream_, params);
}

void CudaExecutor::signal(Flag which, uint64_t epoch) {
  const FlagStep write{flag(rank_, which, epoch), epochBase(), epoch, false};
  queueFlagSteps({&write, 1});
}

void CudaExecutor::await(Flag which, uint64_t epoch, int only) {
  std::array<FlagStep, cuda::kMaxSources> waits;
  size_t n = 0;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_ || (only >= 0 && q != only)) continue;
    waits[n++] = {flag(q, which, epoch), epochBase(), epoch, true};
  }
  queueFlagSteps({waits.data(), n});
}

cuda::Agreement CudaExecutor::noAgreement() {
  cuda::Agreement a{};
  a.claim = reinterpret_cast<uint32_t*>(bases_[rank_] + kClaimOffset);
  a.report = report_;
  a.abort = reinterpret_cast<volatile uint64_t*>(bases_[rank_] + kAbortOffset);
  return a;
}

cuda::Descriptor* CudaExecutor::descriptor(int q, uint64_t epoch) const {
  return reinterpret_cast<cuda::Descriptor*>(bases_[q] + lane_->descriptorsAt +
                                             (epoch % 2) * sizeof(cuda::Descriptor));
}

cuda::Descriptor* CudaExecutor::pairDescriptor(int sender, int receiver, uint64_t chunk) const {
  return reinterpret_cast<cuda::Descriptor*>(pair(sender, receiver) + kPairDescOffset +
                                             (chunk % 2) * sizeof(cuda::Descriptor));
}

cuda::Agreement CudaExecutor::transferAgreement() {
  cuda::Agreement a = noAgreement();
  a.pairCounts = sentBase(0);  // [peer][sent, taken] in the graph lane; null in the eager one
  return a;
}

cuda::Agreement CudaExecutor::publishing(uint64_t epoch) {
  cuda::Agreement a = noAgreement();
  if (epoch == firstEpoch_) {
    a.publish[a.npublish++] = {descriptor(rank_, epoch), stepTagged(described_, epoch), -1};
    a.factorAt = describedFactor_;
    a.replayEpoch = epochBase();
  }
  return a;
}

cuda::Agreement CudaExecutor::expecting(uint64_t epoch, int only) {
  cuda::Agreement a = noAgreement();
  if (epoch != firstEpoch_) return a;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_ || (only >= 0 && q != only)) continue;
    a.expect[a.nexpect++] = {descriptor(q, epoch), stepTagged(described_, epoch), q};
  }
  a.factorAt = describedFactor_;
  a.replayEpoch = epochBase();
  return a;
}

bool CudaExecutor::fusableTransfers() const {
  return paths_.fusedTransfers && size_ > 1 && !lane_->onDevice;
}

bool CudaExecutor::fusable(size_t largest) const {
  return paths_.fused && size_ > 1 && !lane_->onDevice && largest <= paths_.fusedMostBytes;
}

uint32_t CudaExecutor::everyPeer() const {
  const uint32_t all = size_ == 32 ? ~0u : (1u << size_) - 1;
  return all & ~(1u << rank_);
}

void CudaExecutor::copy(std::span<const cuda::Segment> segments, const cuda::Agreement& agreement) {
  cuda::CopyParams params{};
  params.agreement = agreement;
  uint64_t longest = 0;
  for (const cuda::Segment& s : segments) {
    if (s.bytes == 0 || s.dst == s.src) continue;
    if (params.count == cuda::kMaxSegments) {
      kernels_->copy(stream_, params, longest);
      params.count = 0;
      longest = 0;
      params.agreement = noAgreement();  // the first launch checked and published
    }
    params.segments[params.count++] = s;
    longest = std::max(longest, s.bytes);
  }
  kernels_->copy(stream_, params, longest);
}

void CudaExecutor::copy(std::initializer_list<cuda::Segment> segments,
                        const cuda::Agreement& agreement) {
  copy(std::span<const cuda::Segment>(segments.begin(), segments.size()), agreement);
}

void CudaExecutor::reduce(void* dst, const Sources& srcs, size_t count, const CollectiveArgs& args,
                          const cuda::Agreement& agreement) {
  cuda::ReduceParams params{};
  params.dst = dst;
  params.nsrc = srcs.n;
  for (int s = 0; s < srcs.n; ++s) params.srcs[s] = srcs.items[static_cast<size_t>(s)];
  params.count = count;
  params.factor = args.op.factor();
  params.factorAt = args.op.deviceFactor();
  params.divisor = size_;
  params.agreement = agreement;
  kernels_->reduce(stream_, args.type, args.op.kind(), params);
}

template <class Fill>
void CudaExecutor::queue(const std::string& op, std::span<const std::shared_ptr<OpState>> states,
                         const OpOptions& options, std::chrono::milliseconds timeout, Fill&& fill) {
  const Driver& d = Driver::get();
  if (options.deviceIndex != device_) {
    throw Error(ErrorCode::kInvalidArgument, op, rank_,
                "the tensors are on cuda:" + std::to_string(options.deviceIndex) +
                    " but this communicator's CUDA collectives run on cuda:" +
                    std::to_string(device_) + "; use one GPU per rank and communicator");
  }
  const trace::Span span("cuda enqueue");
  std::lock_guard<std::mutex> lock(enqueueMutex_);
  cuda::ContextGuard guard(context_);
  stream_ = static_cast<CUstream>(options.stream);
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  cuuint64_t captureId = 0;
  check(d.cuStreamGetCaptureInfo(stream_, &capture, &captureId, nullptr, nullptr, nullptr, nullptr),
        op, rank_, "cuStreamGetCaptureInfo");
  if (capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
    throw Error(ErrorCode::kInvalidArgument, op, rank_,
                "the stream's CUDA graph capture was invalidated by an earlier error; end that "
                "capture and capture again");
  }
  const bool captured = capture == CU_STREAM_CAPTURE_STATUS_ACTIVE;
  if (failures_.failed()) throw failures_.failureError(op);
  for (const auto& state : states) {
    FlightRecorder::instance().started(state->flightId);
    state->completer = this;  // the monitor completes it (a callback there must not wait)
  }
  lane_ = captured ? &graph_ : &eager_;
  if (captured) {
    graphsCaptured_ = true;
    graph_.epoch = 0;
    std::fill(graph_.sent.begin(), graph_.sent.end(), 0);
    std::fill(graph_.taken.begin(), graph_.taken.end(), 0);
  }
  CUevent event = nullptr;
  Lane& lane = *lane_;
  // Part of the call may be queued when something fails: this rank's epochs and channels
  // no longer match its peers', so the communicator cannot go on (and its peers must not
  // wait for it).
  auto failed = [&](ErrorCode code, const std::string& what) {
    if (event != nullptr) {
      // A spare may be the handle the eager lane's last end still names.
      if (eager_.lastEnd == event) eager_.lastEnd = nullptr;
      d.cuEventDestroy(event);
    }
    failures_.fail(code, rank_, what);
  };
  try {
    // A capturing stream refuses cuStreamGetId; within one capture its streams all live,
    // so their handles tell them apart.
    unsigned long long streamId = reinterpret_cast<uintptr_t>(stream_);
    if (!captured) check(d.cuStreamGetId(stream_, &streamId), op, rank_, "cuStreamGetId");
    const bool sameCapture = !captured || lane.lastCapture == captureId;
    if (lane.lastStream && *lane.lastStream != streamId && sameCapture && lane.lastEnd) {
      check(d.cuStreamWaitEvent(stream_, lane.lastEnd, 0), op, rank_, "cuStreamWaitEvent");
    }
    firstEpoch_ = lane.epoch + 1;
    fill();
    if (captured) {
      finishCapturedCall();
      check(d.cuEventRecord(lane.lastEnd, stream_), op, rank_, "cuEventRecord");
    } else {
      {
        // Events finished with come back to a spare list: creating one is a driver call
        // on every call's path.
        std::lock_guard<std::mutex> pendingLock(pendingMutex_);
        if (!spareEvents_.empty()) {
          event = spareEvents_.back();
          spareEvents_.pop_back();
        }
      }
      if (event == nullptr) {
        check(d.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), op, rank_, "cuEventCreate");
      }
      check(d.cuEventRecord(event, stream_), op, rank_, "cuEventRecord");
      // One event marks both the call's end for the monitor and the lane's last end for
      // the next call from another stream: a record is a driver call on every call's path.
      // The monitor may hand it back as a spare before the next call waits for it; only
      // queue() records events, after that wait, so it still marks this call's end then.
      lane.lastEnd = event;
    }
    lane.lastStream = streamId;
    lane.lastCapture = captureId;
  } catch (const Error& e) {
    // The driver's errors and the launches name no operation: this call's, with its rank.
    const Error named = e.op() == op ? e : Error(e.code(), op, rank_, e.detail());
    failed(named.code(), named.what());
    if (!captured) drainQueuedPart();
    throw named;
  } catch (const std::exception& e) {
    failed(ErrorCode::kInternal, std::string("queueing it failed: ") + e.what());
    if (!captured) drainQueuedPart();
    throw;
  }
  if (captured) {
    // Captured, it has done what it will do now: it runs at every replay of the graph (a
    // replay's failure shows as the communicator's, through the monitor).
    for (const auto& state : states) state->complete(nullptr);
    return;
  }
  {
    std::lock_guard<std::mutex> pendingLock(pendingMutex_);
    // A call of collective steps took epochs from firstEpoch_ on; sends and receives none.
    const uint64_t firstStep = eager_.epoch >= firstEpoch_ ? firstEpoch_ : 0;
    pending_.push_back(Pending{
        event, {states.begin(), states.end()}, deadlineAfter(timeout), op, firstStep, {}, {}});
    if (eager_.sent != issuedSent_ || eager_.taken != issuedTaken_) {
      pending_.back().sentAfter = eager_.sent;
      pending_.back().takenAfter = eager_.taken;
      issuedSent_ = eager_.sent;  // same sizes: copies without allocating
      issuedTaken_ = eager_.taken;
    }
  }
  pendingChanged_.notify_all();
}

void CudaExecutor::drainQueuedPart() noexcept {
  const Driver& d = Driver::get();
  CUevent event = nullptr;
  if (d.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) return;
  if (d.cuEventRecord(event, stream_) != CUDA_SUCCESS) {
    d.cuEventDestroy(event);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(pendingMutex_);
    draining_.push_back(event);
  }
  pendingChanged_.notify_all();
}

void CudaExecutor::finishCapturedCall() {
  // A counter that ended odd would start the next call on slot 0: one more write of the
  // flag (announcing a step or chunk with nothing in it) makes it even.
  std::vector<FlagStep> writes;
  std::vector<cuda::Advance> advances;
  auto evenUp = [&](uint64_t& count, uint8_t* flag, uint64_t* base) {
    if (count % 2 == 1) writes.push_back({flag, base, ++count, false});
    if (count > 0) advances.push_back({base, count});
  };
  evenUp(graph_.epoch, flag(rank_, kDone, graph_.epoch + 1), epochBase());
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    evenUp(graph_.sent[q], pair(rank_, q) + kSent * kFlagStride, sentBase(q));
    evenUp(graph_.taken[q], pair(rank_, q) + kTaken * kFlagStride, takenBase(q));
  }
  // The advances go with the last batch, after every write that reads the old counts.
  for (size_t i = 0; i < writes.size(); i += cuda::kMaxSources) {
    const size_t n = std::min<size_t>(cuda::kMaxSources, writes.size() - i);
    const bool last = i + n == writes.size();
    queueFlagSteps({writes.data() + i, n}, last ? std::span<const cuda::Advance>(advances)
                                                : std::span<const cuda::Advance>());
  }
  if (writes.empty()) queueFlagSteps({}, advances);
}

void CudaExecutor::enqueue(const CollectiveArgs& args, const std::shared_ptr<OpState>& state,
                           const OpOptions& options, std::chrono::milliseconds timeout) {
  queue(std::string(collectiveName(args.kind)), {&state, 1}, options, timeout, [&] {
    described_ = describe(args);
    describedFactor_ = args.op.deviceFactor();
    switch (args.kind) {
      case CollectiveKind::kAllReduce: allReduce(args); break;
      case CollectiveKind::kReduce: reduceToRoot(args); break;
      case CollectiveKind::kBroadcast: broadcast(args); break;
      case CollectiveKind::kAllGather: allGather(args, false); break;
      case CollectiveKind::kGather: allGather(args, true); break;
      case CollectiveKind::kReduceScatter: reduceScatter(args); break;
      case CollectiveKind::kAllToAll: args.variable ? allToAllV(args) : allToAll(args); break;
      case CollectiveKind::kScatter: scatter(args); break;
      case CollectiveKind::kBarrier: barrier(); break;
    }
  });
}

void CudaExecutor::enqueueTransfers(std::span<const Transfer> transfers,
                                    std::span<const std::shared_ptr<OpState>> states,
                                    const OpOptions& options, std::chrono::milliseconds timeout) {
  std::string op = "send/recv group";
  if (transfers.size() == 1) op = transfers[0].kind == Transfer::Kind::kSend ? "send" : "recv";
  // Refused before anything is queued (a call that fails half-queued ends the communicator).
  if (paths_.fusedTransfers && transfers.size() > static_cast<size_t>(cuda::kMaxTransferMessages)) {
    throw Error(ErrorCode::kInvalidArgument, op, rank_,
                "this group has " + std::to_string(transfers.size()) +
                    " sends and receives on CUDA tensors, and loom moves at most " +
                    std::to_string(cuda::kMaxTransferMessages) +
                    " in one group where every rank has a GPU of its own; split it into "
                    "several groups (batch_isend_irecv calls), keeping each pair's sends and "
                    "receives in the same order on both ranks");
  }
  // A peer that has destroyed its communicator had finished every call it issued: nothing
  // sent to it now is ever taken (a small send would end in its mailbox, "sent"), nothing
  // received from it ever sent. Each such transfer is refused alone, as on CPU, and the
  // group's others go on: their peers run their halves (a live peer's send held back here
  // would be taken by this rank's next receive from it).
  auto departedError = [&](const Transfer& t) {
    const bool isSend = t.kind == Transfer::Kind::kSend;
    return Error(ErrorCode::kPeerFailure, isSend ? "send" : "recv", rank_,
                 std::string(isSend ? "to" : "from") + " rank " + std::to_string(t.peer) +
                     " (tag " + std::to_string(t.tag) + ", " + std::to_string(t.bytes) +
                     " bytes, CUDA): the " + (isSend ? "receiver" : "sender") +
                     " destroyed its communicator");
  };
  std::vector<size_t> refused;
  for (size_t i = 0; i < transfers.size(); ++i) {
    if (failures_.stateOf(transfers[i].peer) == RankState::kDeparted) refused.push_back(i);
  }
  if (refused.empty()) {
    queue(op, states, options, timeout, [&] { transfer(transfers, kSendRecv); });
    return;
  }
  if (refused.size() == transfers.size()) throw departedError(transfers[refused[0]]);
  std::vector<Transfer> live;
  std::vector<std::shared_ptr<OpState>> liveStates;
  for (size_t i = 0, r = 0; i < transfers.size(); ++i) {
    if (r < refused.size() && refused[r] == i) {
      ++r;
      continue;
    }
    live.push_back(transfers[i]);
    liveStates.push_back(states[i]);
  }
  queue(op, liveStates, options, timeout, [&] { transfer(live, kSendRecv); });
  // Only once the rest is queued: a throw above leaves every request to the caller to fail.
  for (size_t i : refused)
    states[i]->complete(std::make_exception_ptr(departedError(transfers[i])));
}

}  // namespace loom::detail
