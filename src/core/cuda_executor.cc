// CUDA collectives among the ranks of one host: see cuda_executor.h.

#include "core/cuda_executor.h"

#include <algorithm>
#include <string>

#include "core/flight_recorder.h"
#include "cuda/driver.h"
#include "loom/error.h"

namespace loom::detail {

namespace {

using Clock = std::chrono::steady_clock;
using cuda::check;
using cuda::Driver;

// The workspace: flags (one 64-byte line each, plus the abort word), then the slots.
constexpr size_t kFlagStride = 64;
constexpr size_t kAbortOffset = 3 * kFlagStride;
constexpr size_t kDataOffset = 64 << 10;
// A value above any epoch: written into every flag to release waits when the
// communicator fails (waits compare as (int64_t)(flag - epoch) >= 0).
constexpr uint64_t kReleased = uint64_t{1} << 62;
// All reductions up to this many bytes read every peer's whole slot (one-shot: one
// synchronisation); larger ones reduce a share each and gather the shares (two-shot).
// Ranks that share one GPU always go one-shot: they take turns on it, and a second round of
// waits costs a switch between processes (about 135 us on an H100, docs/PERFORMANCE.md)
// while re-reading every input costs little.
constexpr size_t kOneShotBytes = 256 << 10;

size_t roundDown(size_t v, size_t to) {
  return v / to * to;
}
size_t clipped(size_t count, size_t lo, size_t n) {
  return lo >= count ? 0 : std::min(n, count - lo);
}
const uint8_t* at(const void* p, size_t bytes) {
  return static_cast<const uint8_t*>(p) + bytes;
}
uint8_t* at(void* p, size_t bytes) {
  return static_cast<uint8_t*>(p) + bytes;
}

}  // namespace

CudaExecutor::CudaExecutor(int device, size_t chunkBytes, std::optional<size_t> oneShotBytes,
                           FdExchange exchange, FailureDomain& failures, Clock::time_point deadline)
    : device_(device),
      chunk_(chunkBytes),
      rank_(exchange.localRank),
      size_(exchange.localSize),
      failures_(failures) {
  const Driver& d = Driver::get();
  const std::string& op = exchange.op;
  if (size_ > cuda::kMaxSources) {
    throw Error(ErrorCode::kUnsupported, op, exchange.rank,
                "CUDA collectives take at most " + std::to_string(cuda::kMaxSources) +
                    " ranks per host; this communicator has " + std::to_string(size_));
  }
  CUdevice dev = 0;
  check(d.cuDeviceGet(&dev, device), op, exchange.rank, "cuDeviceGet");
  check(d.cuDevicePrimaryCtxRetain(&context_, dev), op, exchange.rank, "cuDevicePrimaryCtxRetain");
  cuda::ContextGuard guard(context_);
  try {
    check(d.cuStreamCreate(&abortStream_, CU_STREAM_NON_BLOCKING), op, exchange.rank,
          "cuStreamCreate");
    kernels_ = std::make_unique<cuda::Kernels>();
    const size_t bytes = kDataOffset + 4 * chunk_;
    mine_ = cuda::SharedMemory::allocate(dev, bytes);
    posix::Fd exported = mine_->exportFd();
    std::vector<posix::Fd> fds = exchangeFds(exchange, exported.get(), deadline);
    bool sharedGpu = true;  // every workspace on this rank's GPU: the ranks share it
    peers_.resize(static_cast<size_t>(size_));
    bases_.resize(static_cast<size_t>(size_));
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) {
        bases_[q] = reinterpret_cast<uint8_t*>(mine_->address());
        continue;
      }
      peers_[q] = cuda::SharedMemory::open(fds[q].get(), mine_->bytes(), dev);
      bases_[q] = reinterpret_cast<uint8_t*>(peers_[q]->address());
      int ordinal = -1;
      if (d.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                  peers_[q]->address()) != CUDA_SUCCESS ||
          ordinal != device) {
        sharedGpu = false;
      }
    }
    oneShotBytes_ = oneShotBytes.value_or(sharedGpu ? SIZE_MAX : kOneShotBytes);
  } catch (...) {
    // A peer gone during the exchange, no memory, ...: give back what was taken so far (the
    // destructor does not run for an object whose constructor threw).
    peers_.clear();
    mine_.reset();
    kernels_.reset();
    if (abortStream_ != nullptr) d.cuStreamDestroy(abortStream_);
    d.cuDevicePrimaryCtxRelease(dev);
    throw;
  }
  monitor_ = std::thread([this] { monitor(); });
}

CudaExecutor::~CudaExecutor() {
  {
    std::unique_lock<std::mutex> lock(pendingMutex_);
    // Let queued collectives finish (peers are still running them); release them if the
    // communicator has failed meanwhile (the monitor does).
    pendingChanged_.wait(lock, [this] { return pending_.empty(); });
    stopping_ = true;
  }
  pendingChanged_.notify_all();
  monitor_.join();
  const Driver& d = Driver::get();
  cuda::ContextGuard guard(context_);
  d.cuStreamSynchronize(abortStream_);
  d.cuStreamDestroy(abortStream_);
  peers_.clear();
  mine_.reset();
  kernels_.reset();
  CUdevice dev = 0;
  d.cuDeviceGet(&dev, device_);
  d.cuDevicePrimaryCtxRelease(dev);
}

uint8_t* CudaExecutor::in(int q, uint64_t epoch) const {
  return bases_[q] + kDataOffset + (epoch % 2) * 2 * chunk_;
}

uint8_t* CudaExecutor::reduced(int q, uint64_t epoch) const {
  return in(q, epoch) + chunk_;
}

uint64_t CudaExecutor::beginStep() {
  const uint64_t e = ++epoch_;
  // Slot e % 2 was last used in step e - 2: wait until every peer is done reading it.
  if (e > 2) await(kDone, e - 2);
  return e;
}

void CudaExecutor::signal(Flag flag, uint64_t epoch) {
  // The default write is ordered after all earlier work on the stream, with a fence.
  auto address = reinterpret_cast<CUdeviceptr>(bases_[rank_] + flag * kFlagStride);
  check(Driver::get().cuStreamWriteValue64(stream_, address, epoch, CU_STREAM_WRITE_VALUE_DEFAULT),
        "cuda", rank_, "cuStreamWriteValue64");
}

void CudaExecutor::await(Flag flag, uint64_t epoch, int only) {
  std::vector<CUstreamBatchMemOpParams> waits;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_ || (only >= 0 && q != only)) continue;
    CUstreamBatchMemOpParams p{};
    p.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    p.waitValue.address = reinterpret_cast<CUdeviceptr>(bases_[q] + flag * kFlagStride);
    p.waitValue.value64 = epoch;
    p.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
    waits.push_back(p);
  }
  if (waits.empty()) return;
  check(Driver::get().cuStreamBatchMemOp(stream_, static_cast<unsigned>(waits.size()), waits.data(),
                                         0),
        "cuda", rank_, "cuStreamBatchMemOp");
}

void CudaExecutor::copy(const std::vector<cuda::Segment>& segments) {
  cuda::CopyParams params{};
  params.abort = reinterpret_cast<const volatile uint64_t*>(bases_[rank_] + kAbortOffset);
  uint64_t longest = 0;
  for (const cuda::Segment& s : segments) {
    if (s.bytes == 0 || s.dst == s.src) continue;
    if (params.count == cuda::kMaxSegments) {
      kernels_->copy(stream_, params, longest);
      params.count = 0;
      longest = 0;
    }
    params.segments[params.count++] = s;
    longest = std::max(longest, s.bytes);
  }
  kernels_->copy(stream_, params, longest);
}

void CudaExecutor::reduce(void* dst, std::vector<const void*> srcs, size_t count,
                          const CollectiveArgs& args) {
  cuda::ReduceParams params{};
  params.dst = dst;
  params.nsrc = static_cast<int>(srcs.size());
  for (size_t s = 0; s < srcs.size(); ++s) params.srcs[s] = srcs[s];
  params.count = count;
  params.factor = args.op.factor();
  params.divisor = size_;
  params.abort = reinterpret_cast<const volatile uint64_t*>(bases_[rank_] + kAbortOffset);
  kernels_->reduce(stream_, args.type, args.op.kind(), params);
}

void CudaExecutor::enqueue(const CollectiveArgs& args, const std::shared_ptr<OpState>& state,
                           const OpOptions& options, std::chrono::milliseconds timeout) {
  const std::string op(collectiveName(args.kind));
  const Driver& d = Driver::get();
  if (options.deviceIndex != device_) {
    throw Error(ErrorCode::kInvalidArgument, op, rank_,
                "the tensors are on cuda:" + std::to_string(options.deviceIndex) +
                    " but this communicator's CUDA collectives run on cuda:" +
                    std::to_string(device_) + "; use one GPU per rank and communicator");
  }
  if (args.kind == CollectiveKind::kAllToAll && args.variable && !equalBlocks(args)) {
    throw Error(ErrorCode::kUnsupported, op, rank_,
                "uneven split sizes on CUDA tensors are not supported yet; pass equal splits "
                "or CPU tensors");
  }
  std::lock_guard<std::mutex> lock(enqueueMutex_);
  cuda::ContextGuard guard(context_);
  stream_ = static_cast<CUstream>(options.stream);
  CUstreamCaptureStatus capture = CU_STREAM_CAPTURE_STATUS_NONE;
  check(d.cuStreamIsCapturing(stream_, &capture), op, rank_, "cuStreamIsCapturing");
  if (capture != CU_STREAM_CAPTURE_STATUS_NONE) {
    throw Error(ErrorCode::kUnsupported, op, rank_,
                "capturing loom collectives in a CUDA graph is not supported yet; run them "
                "outside the capture");
  }
  if (failures_.failed()) throw failures_.failureError(op);
  FlightRecorder::instance().started(state->flightId);
  switch (args.kind) {
    case CollectiveKind::kAllReduce: allReduce(args); break;
    case CollectiveKind::kReduce: reduceToRoot(args); break;
    case CollectiveKind::kBroadcast: broadcast(args); break;
    case CollectiveKind::kAllGather: allGather(args, false); break;
    case CollectiveKind::kGather: allGather(args, true); break;
    case CollectiveKind::kReduceScatter: reduceScatter(args); break;
    case CollectiveKind::kAllToAll: allToAll(args); break;
    case CollectiveKind::kScatter: scatter(args); break;
    case CollectiveKind::kBarrier: barrier(); break;
  }
  CUevent event = nullptr;
  check(d.cuEventCreate(&event, CU_EVENT_DISABLE_TIMING), op, rank_, "cuEventCreate");
  check(d.cuEventRecord(event, stream_), op, rank_, "cuEventRecord");
  {
    std::lock_guard<std::mutex> pendingLock(pendingMutex_);
    pending_.push_back(Pending{event, state, Clock::now() + timeout, op});
  }
  pendingChanged_.notify_all();
}

void CudaExecutor::allReduce(const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t total = args.count;
  const size_t perStep = chunk_ / es;
  if (size_ == 1) {
    reduce(args.output, {args.input}, total, args);
    return;
  }
  const bool oneShot = total * es <= oneShotBytes_;
  for (size_t lo = 0; lo < total; lo += perStep) {
    const size_t n = std::min(perStep, total - lo);
    const uint64_t e = beginStep();
    copy({{in(rank_, e), at(args.input, lo * es), n * es}});
    signal(kReady, e);
    await(kReady, e);
    if (oneShot) {
      std::vector<const void*> srcs;
      for (int q = 0; q < size_; ++q) srcs.push_back(in(q, e));
      reduce(at(args.output, lo * es), srcs, n, args);
    } else {
      // Shares of whole 16-byte vectors; rank q reduces share q into its reduced half.
      const size_t vector = 16 / std::min<size_t>(es, 16);
      const size_t share = (n / size_ + vector) / vector * vector;
      std::vector<const void*> srcs;
      for (int q = 0; q < size_; ++q) srcs.push_back(in(q, e) + rank_ * share * es);
      reduce(reduced(rank_, e), srcs, clipped(n, rank_ * share, share), args);
      signal(kReduced, e);
      await(kReduced, e);
      std::vector<cuda::Segment> gather;
      for (int q = 0; q < size_; ++q) {
        gather.push_back({at(args.output, (lo + q * share) * es), reduced(q, e),
                          clipped(n, q * share, share) * es});
      }
      copy(gather);
    }
    signal(kDone, e);
  }
}

void CudaExecutor::reduceToRoot(const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t perStep = chunk_ / es;
  if (size_ == 1) {
    reduce(args.output, {args.input}, args.count, args);
    return;
  }
  for (size_t lo = 0; lo < args.count; lo += perStep) {
    const size_t n = std::min(perStep, args.count - lo);
    const uint64_t e = beginStep();
    copy({{in(rank_, e), at(args.input, lo * es), n * es}});
    signal(kReady, e);
    if (rank_ == args.root) {
      await(kReady, e);
      std::vector<const void*> srcs;
      for (int q = 0; q < size_; ++q) srcs.push_back(in(q, e));
      reduce(at(args.output, lo * es), srcs, n, args);
    }
    signal(kDone, e);
  }
}

void CudaExecutor::broadcast(const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t perStep = chunk_ / es;
  for (size_t lo = 0; lo < args.count; lo += perStep) {
    const size_t bytes = std::min(perStep, args.count - lo) * es;
    const uint64_t e = beginStep();
    if (rank_ == args.root) {
      copy({{in(rank_, e), at(args.input, lo * es), bytes},
            {at(args.output, lo * es), at(args.input, lo * es), bytes}});
      signal(kReady, e);
    } else {
      await(kReady, e, args.root);
      copy({{at(args.output, lo * es), in(args.root, e), bytes}});
    }
    signal(kDone, e);
  }
}

void CudaExecutor::allGather(const CollectiveArgs& args, bool onlyRoot) {
  // Rank q's block: outputCounts[q] elements (count for gather, whose outputs only the
  // root has); each step moves up to a chunk of every block.
  const size_t es = elementSize(args.type);
  const size_t perStep = chunk_ / es;
  auto countOf = [&](int q) { return onlyRoot ? args.count : args.outputCounts[q]; };
  size_t longest = 0;
  for (int q = 0; q < size_; ++q) longest = std::max(longest, countOf(q));
  const size_t mine = countOf(rank_);
  const bool receives = !onlyRoot || rank_ == args.root;
  for (size_t lo = 0; lo < longest; lo += perStep) {
    const uint64_t e = beginStep();
    copy({{in(rank_, e), at(args.input, lo * es), clipped(mine, lo, perStep) * es}});
    signal(kReady, e);
    if (receives) {
      await(kReady, e);
      std::vector<cuda::Segment> out;
      for (int q = 0; q < size_; ++q) {
        const void* src = q == rank_ ? at(args.input, lo * es) : in(q, e);
        out.push_back({at(args.outputs[q], lo * es), src, clipped(countOf(q), lo, perStep) * es});
      }
      copy(out);
    }
    signal(kDone, e);
  }
}

void CudaExecutor::reduceScatter(const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  // The slot holds one block per rank.
  const size_t block = roundDown(chunk_ / size_, 16);
  const size_t perStep = block / es;
  auto countOf = [&](int q) { return args.variable ? args.inputCounts[q] : args.count; };
  size_t longest = 0;
  for (int q = 0; q < size_; ++q) longest = std::max(longest, countOf(q));
  if (size_ == 1) {
    reduce(args.output, {args.inputs[0]}, countOf(0), args);
    return;
  }
  for (size_t lo = 0; lo < longest; lo += perStep) {
    const uint64_t e = beginStep();
    std::vector<cuda::Segment> stage;
    for (int q = 0; q < size_; ++q) {
      stage.push_back({in(rank_, e) + q * block, at(args.inputs[q], lo * es),
                       clipped(countOf(q), lo, perStep) * es});
    }
    copy(stage);
    signal(kReady, e);
    await(kReady, e);
    std::vector<const void*> srcs;
    for (int q = 0; q < size_; ++q) srcs.push_back(in(q, e) + rank_ * block);
    reduce(at(args.output, lo * es), srcs, clipped(countOf(rank_), lo, perStep), args);
    signal(kDone, e);
  }
}

bool CudaExecutor::equalBlocks(const CollectiveArgs& args) {
  // Every block of this rank the same size, sent and received: then so are its peers'
  // (their sends to it are its receives), unless they pass split sizes that do not match.
  for (size_t q = 0; q < args.inputCounts.size(); ++q) {
    if (args.inputCounts[q] != args.inputCounts[0] || args.outputCounts[q] != args.inputCounts[0])
      return false;
  }
  return true;
}

void CudaExecutor::allToAll(const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t count = args.variable ? args.inputCounts[0] : args.count;
  const size_t block = roundDown(chunk_ / size_, 16);
  const size_t perStep = block / es;
  for (size_t lo = 0; lo < count; lo += perStep) {
    const size_t bytes = clipped(count, lo, perStep) * es;
    const uint64_t e = beginStep();
    std::vector<cuda::Segment> stage;
    for (int q = 0; q < size_; ++q) {
      stage.push_back({in(rank_, e) + q * block, at(args.inputs[q], lo * es), bytes});
    }
    copy(stage);
    signal(kReady, e);
    await(kReady, e);
    std::vector<cuda::Segment> out;
    for (int q = 0; q < size_; ++q) {
      out.push_back({at(args.outputs[q], lo * es), in(q, e) + rank_ * block, bytes});
    }
    copy(out);
    signal(kDone, e);
  }
}

void CudaExecutor::scatter(const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t block = roundDown(chunk_ / size_, 16);
  const size_t perStep = block / es;
  for (size_t lo = 0; lo < args.count; lo += perStep) {
    const size_t bytes = clipped(args.count, lo, perStep) * es;
    const uint64_t e = beginStep();
    if (rank_ == args.root) {
      std::vector<cuda::Segment> stage;
      for (int q = 0; q < size_; ++q) {
        stage.push_back({in(rank_, e) + q * block, at(args.inputs[q], lo * es), bytes});
      }
      stage.push_back({at(args.output, lo * es), at(args.inputs[rank_], lo * es), bytes});
      copy(stage);
      signal(kReady, e);
    } else {
      await(kReady, e, args.root);
      copy({{at(args.output, lo * es), in(args.root, e) + rank_ * block, bytes}});
    }
    signal(kDone, e);
  }
}

void CudaExecutor::barrier() {
  const uint64_t e = beginStep();
  signal(kReady, e);
  await(kReady, e);
  signal(kDone, e);
}

void CudaExecutor::release() {
  if (released_.exchange(true)) return;
  const Driver& d = Driver::get();
  // The abort word first (kernels still queued skip their work), then every flag.
  d.cuStreamWriteValue64(abortStream_, reinterpret_cast<CUdeviceptr>(bases_[rank_] + kAbortOffset),
                         1, CU_STREAM_WRITE_VALUE_DEFAULT);
  for (uint8_t* base : bases_) {
    for (int flag = kReady; flag <= kDone; ++flag) {
      d.cuStreamWriteValue64(abortStream_, reinterpret_cast<CUdeviceptr>(base + flag * kFlagStride),
                             kReleased, CU_STREAM_WRITE_VALUE_DEFAULT);
    }
  }
}

void CudaExecutor::monitor() {
  const Driver& d = Driver::get();
  cuda::ContextGuard guard(context_);
  // Poll often while a collective is young (its request completes within microseconds of
  // its event), every 100 us once it has run for half a millisecond.
  Clock::time_point since = Clock::now();
  std::unique_lock<std::mutex> lock(pendingMutex_);
  while (true) {
    if (pending_.empty()) {
      if (stopping_) return;
      pendingChanged_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
      since = Clock::now();
      continue;
    }
    Pending& first = pending_.front();  // one stream per enqueue order: finish in order
    const CUresult state = d.cuEventQuery(first.event);
    std::exception_ptr failure;
    bool finished = state == CUDA_SUCCESS;
    if (!finished && state != CUDA_ERROR_NOT_READY) {
      failure = std::make_exception_ptr(
          Error(ErrorCode::kSystem, first.op, rank_,
                "the GPU reported an error while running it (a fault in a kernel before it, "
                "or the device was lost); see the CUDA error from PyTorch"));
      finished = true;
    } else if (!finished && (failures_.failed() || Clock::now() >= first.deadline)) {
      if (!failures_.failed()) {
        failures_.fail(ErrorCode::kTimeout, -1,
                       first.op +
                           " on CUDA tensors did not finish within its timeout (some "
                           "rank has not issued it, or its GPU is stuck)");
      }
      release();
      failure = std::make_exception_ptr(failures_.failureError(first.op));
      finished = true;
    }
    if (!finished) {
      lock.unlock();
      if (Clock::now() - since > std::chrono::microseconds(500)) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      } else {
        std::this_thread::yield();
      }
      lock.lock();
      continue;
    }
    Pending done = std::move(first);
    pending_.pop_front();
    lock.unlock();
    d.cuEventDestroy(done.event);
    done.state->complete(failure);
    since = Clock::now();
    lock.lock();
    pendingChanged_.notify_all();
  }
}

}  // namespace loom::detail
