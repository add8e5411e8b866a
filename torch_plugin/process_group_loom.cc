// ProcessGroupLoom's lifecycle: creation, splitting, coalescing, timeouts, abort.

#include "process_group_loom.h"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "exit_shutdown.h"
#include "launch.h"
#include "store_adapter.h"
#include "transport/shm/lending.h"
#include "util/env.h"
#include "util/worker.h"
#ifdef LOOM_HAVE_CUDA
#include "cuda/driver.h"
#endif

namespace loom::torch_plugin {

namespace {

// allocateTensor lends buffers from this size up (see there).
constexpr size_t kSmallestLent = size_t{64} << 10;

CommOptions commOptions(const c10d::Backend::Options& options) {
  CommOptions c;
  c.timeout = options.timeout;
  c.name = options.group_name.empty() ? "loom" : options.group_name;
  c.rankLegend = ranksOf(options.group_name, options.group_desc, options.global_ranks_in_group);
  return c;
}

// Runs `f`, turning loom errors into torch errors for Python (their messages followed by
// `legend`, GroupTies).
template <class F>
auto translated(F&& f, const std::string& legend = {}) {
  try {
    return f();
  } catch (const Error& e) {
    rethrowForTorch(e, legend);
  }
}

// LOOM_DESYNC_DEBUG=1, or torch's own switch for the same checks.
bool desyncDebugRequested() {
  const char* torch = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  return translated([] { return env::flag("LOOM_DESYNC_DEBUG"); }) ||
         (torch != nullptr && std::string(torch) == "DETAIL");
}

// "[4, 8], [3]": the shapes of `tensors`.
std::string shapesOf(const std::vector<at::Tensor>& tensors) {
  std::string s;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (i > 0) s += ", ";
    s += "[";
    const auto sizes = tensors[i].sizes();
    for (size_t d = 0; d < sizes.size(); ++d) s += (d > 0 ? ", " : "") + std::to_string(sizes[d]);
    s += "]";
  }
  return s;
}

// The communicator of this process's default (world) loom group, from which groups over
// subsets of the world are derived without a store rendezvous.
std::mutex gWorldMutex;
std::weak_ptr<Communicator> gWorld;

}  // namespace

int worldRank() {
  std::lock_guard<std::mutex> lock(gWorldMutex);
  const std::shared_ptr<Communicator> world = gWorld.lock();
  return world ? world->rank() : -1;
}

ProcessGroupLoom::ProcessGroupLoom(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                   c10::intrusive_ptr<Options> options, Maker maker)
    : c10d::Backend(rank, size),
      options_(std::move(options)),
      desyncDebug_(desyncDebugRequested()) {
  ties_->legend = legendOf(
      ranksOf(options_->group_name, options_->group_desc, options_->global_ranks_in_group));
  const auto& global = options_->global_ranks_in_group;
  std::shared_ptr<Communicator> world;
  if (maker == Maker::kTorch) {
    // Only torch's groups: a group a user builds apart, with a store of its own, neither
    // derives from torch's world nor takes its place.
    std::lock_guard<std::mutex> lock(gWorldMutex);
    world = gWorld.lock();
  }
  if (!global.empty() && world) {
    // A group over ranks of the world (new_group, DeviceMesh): torch calls this factory on
    // the members only, which is exactly what subset() needs. The members meet by the ranks
    // and how many groups of them came before, never by torch's name: with
    // use_local_synchronization torch hashes the ranks with how many groups this process
    // knows, which differs between members that are in different earlier groups.
    std::vector<int> members(global.begin(), global.end());
    const std::string tag = "group";
    // The world's own failure numbers ranks as the world does: raised as it is, not with this
    // group's legend (which would map its "rank 1" to the group's rank 1). A failed world
    // still makes groups of ranks that all live (after a timeout, or of the survivors of a
    // rank that died), as Gloo's new_group does.
    translated([&] { world->requireMembersUsable(members, "new_group"); });
    comm_ = translated([&] { return world->subset(members, tag, commOptions(*options_)); },
                       ties_->legend);
    noteLiveGroup(comm_, ties_);
    return;
  }
  comm_ = translated(
      [&] {
        return Communicator::create(rank, size, std::make_shared<StoreAdapter>(store),
                                    commOptions(*options_));
      },
      ties_->legend);
  if (maker == Maker::kTorch && global.empty()) {
    std::lock_guard<std::mutex> lock(gWorldMutex);
    gWorld = comm_;
  }
  noteLiveGroup(comm_, ties_);
}

ProcessGroupLoom::ProcessGroupLoom(std::shared_ptr<Communicator> comm,
                                   c10::intrusive_ptr<Options> options)
    : c10d::Backend(comm->rank(), comm->size()),
      comm_(std::move(comm)),
      options_(std::move(options)),
      desyncDebug_(desyncDebugRequested()) {
  ties_->legend = legendOf(
      ranksOf(options_->group_name, options_->group_desc, options_->global_ranks_in_group));
  noteLiveGroup(comm_, ties_);
}

ProcessGroupLoom::~ProcessGroupLoom() {
  release_resources();
}

void ProcessGroupLoom::release_resources() {
  // A copy taken later on this thread must not ask a group that is gone (other threads'
  // marks are set anew by each call's site()).
  forgetPreparing(this);
  // Tearing the communicator down waits for its queued operations, whose completion may run
  // Python callbacks chained on their futures; those need the GIL, so never hold it here.
  releasingGil([&] { comm_.reset(); });
}

OpOptions ProcessGroupLoom::opOptions(std::chrono::milliseconds timeout, bool blocking) const {
  OpOptions o;
  if (timeout.count() > 0) o.timeout = timeout;  // kUnsetTimeout (-1) means the group's
  // A synchronous call (async_op=False): run it on this thread, as loom's blocking form;
  // launch() releases the GIL meanwhile.
  o.blocking = blocking;
  if (desyncDebug_) o.signature = tLaunchSignature;  // launch() sets it only then
  if (tLaunchStream) {
    // The loom stream orders the call; the host never waits for a CUDA collective (as NCCL,
    // async_op=False makes the current stream wait, in Work.wait()).
    o.device = DeviceKind::kCuda;
    o.deviceIndex = tLaunchStream->device_index();
    o.stream = tLaunchStream->native_handle();
    o.blocking = false;
  }
  return o;
}

std::optional<c10::Stream> ProcessGroupLoom::cudaStreamFor(const CallSite& site,
                                                           const std::vector<at::Tensor>& inputs,
                                                           const std::vector<at::Tensor>& outputs) {
  std::optional<c10::Device> device;
  auto see = [&](const at::Tensor& t) {
    if (!t.defined()) return;
    if (!device) {
      device = t.device();
    } else if (t.device() != *device) {
      invalid(site, "tensors on " + device->str() + " and " + t.device().str() +
                        " in one call; pass them all on one device");
    }
  };
  for (const auto& t : inputs) see(t);
  for (const auto& t : outputs) see(t);
  if (!device || device->is_cpu()) return std::nullopt;
  if (!device->is_cuda()) {
    invalid(site, "tensors on " + device->str() + "; loom takes CPU and CUDA tensors");
  }
  if (const auto bound = getBoundDeviceId(); bound && bound->is_cuda() && *bound != *device) {
    invalid(site, "tensors on " + device->str() + ", but this group is bound to " + bound->str() +
                      " (init_process_group's device_id); pass tensors on " + bound->str());
  }
  const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  // A call the caller waits for (async_op=False) runs on the caller's own stream, as
  // ProcessGroupNCCL's do: there is nothing to overlap, and on a GPU that ranks share, the
  // caller's stream waiting for another stream before its next kernel costs a whole time
  // slice (2.2 ms against 0.17 on an H100 at P = 2, docs/PERFORMANCE.md). The calls of a
  // coalescing block share the block's loom stream.
  if (site.blocking) {
    std::lock_guard<std::mutex> lock(coalesceMutex_);
    if (!coalescing_) return impl.getStream(*device);
  }
  c10::Stream stream = [&] {
    std::lock_guard<std::mutex> lock(streamMutex_);
    // Until a call on it is accepted, the stream's device is only the first asynchronous
    // call's: a call on the wrong GPU, which the engine refuses, must not fix it for good.
    if (!loomStream_ || (!loomStreamAccepted_ && loomStream_->device() != *device)) {
      loomStream_ = impl.getStreamFromGlobalPool(*device, /*isHighPriority=*/false);
    } else if (loomStream_->device() != *device) {
      invalid(site, "this group's CUDA collectives run on " + loomStream_->device().str() +
                        " but these tensors are on " + device->str() +
                        "; use one GPU per rank (init_process_group(device_id=...))");
    }
    return *loomStream_;
  }();
  c10::Event ready(c10::DeviceType::CUDA);
  ready.record(impl.getStream(*device));
  ready.block(stream);
  return stream;
}

void ProcessGroupLoom::acceptedOn(const c10::Stream& stream) {
  // The group has GPU work there now (barrier() settles it); a refused call does not count.
  if (lastGpu_.load(std::memory_order_relaxed) != stream.device_index()) {
    lastGpu_.store(stream.device_index(), std::memory_order_relaxed);
  }
  if (loomStreamAccepted_.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(streamMutex_);
  if (loomStream_ == stream) loomStreamAccepted_.store(true, std::memory_order_relaxed);
}

std::optional<c10::Device> ProcessGroupLoom::barrierGpu() const {
  // Only a group whose calls have run on a GPU has GPU work to settle: a CPU group of a job
  // bound to a GPU (torch gives new groups the default group's device) waits for nothing
  // there, not even for the caller's stream.
  const int last = lastGpu_.load(std::memory_order_relaxed);
  if (last < 0) return std::nullopt;
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(last));
}

namespace {

/// Whether `stream` is being captured into a CUDA graph: what it was given runs at replay,
/// and waiting for it on the host would end the capture.
bool capturing(const c10::Stream& stream) {
#ifdef LOOM_HAVE_CUDA
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  cuuint64_t id = 0;
  const CUresult r =
      cuda::Driver::get().cuStreamGetCaptureInfo(static_cast<CUstream>(stream.native_handle()),
                                                 &status, &id, nullptr, nullptr, nullptr, nullptr);
  return r == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE;
#else
  (void)stream;
  return false;  // no CUDA collectives here, so no captured ones either
#endif
}

}  // namespace

void ProcessGroupLoom::settleGpuWork(c10::Device device) {
  const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  std::optional<c10::Stream> loom;
  {
    std::lock_guard<std::mutex> lock(streamMutex_);
    if (loomStream_ && loomStream_->device() == device) loom = loomStream_;
  }
  const c10::Stream current = impl.getStream(device);
  // A barrier inside a capture meets the others on the host only: the captured work has
  // not run, and a host wait would invalidate the capture.
  if (capturing(current)) return;
  releasingGil([&] {
#ifdef LOOM_HAVE_CUDA
    // Another thread may be capturing in global mode (torch.cuda.graph's default), which
    // forbids this thread's synchronizes unless it asks for relaxed mode.
    const cuda::RelaxedCaptureGuard relaxed;
#endif
    current.synchronize();
    // The loom stream captured by another thread (its asynchronous calls) has nothing to
    // settle until replay.
    if (loom && *loom != current && !capturing(*loom)) loom->synchronize();
  });
}

void ProcessGroupLoom::rejoinRefused(const std::optional<c10::Stream>& stream) noexcept {
  if (!stream) return;
  try {
    const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    if (impl.getStream(stream->device()) == *stream) return;  // a blocking call's: nothing to join
    c10::Event joined(c10::DeviceType::CUDA);
    joined.record(*stream);
    joined.block(impl.getStream(stream->device()));
  } catch (...) {
    // An invalidated capture refuses the join too; the loom error is the one to report.
  }
}

void ProcessGroupLoom::finishOnStream(const c10::Stream& stream,
                                      const std::vector<at::Tensor>& uses,
                                      const std::vector<at::Tensor>& outputs,
                                      const std::function<void()>& finisher,
                                      c10::ArrayRef<Request> requests) {
  const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  if (finisher) {
    c10::StreamGuard guard(stream);
    finisher();
  }
  for (const auto* list : {&uses, &outputs}) {
    for (const auto& t : *list) {
      if (t.defined() && t.has_storage())
        impl.recordDataPtrOnStream(t.storage().data_ptr(), stream);
    }
  }
  if (finisher && !requests.empty()) {
    requests.back().onComplete([keep = finisher](std::exception_ptr) {});
  }
}

void ProcessGroupLoom::abandonIssued(const std::optional<c10::Stream>& stream,
                                     const std::vector<at::Tensor>& uses,
                                     const std::vector<at::Tensor>& outputs,
                                     std::function<void()> finisher,
                                     c10::ArrayRef<Request> requests) {
  if (requests.empty()) return;
  if (stream) {
    const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    for (const auto* list : {&uses, &outputs}) {
      for (const auto& t : *list) {
        if (t.defined() && t.has_storage())
          impl.recordDataPtrOnStream(t.storage().data_ptr(), *stream);
      }
    }
  }
  struct Kept {
    std::function<void()> finisher;
    std::vector<at::Tensor> uses;
    std::vector<at::Tensor> outputs;
  };
  auto kept = std::make_shared<const Kept>(Kept{std::move(finisher), uses, outputs});
  // Released with the last of them to end, on the thread that ends it.
  for (const Request& r : requests) r.onComplete([kept](std::exception_ptr) {});
}

void ProcessGroupLoom::noteAsync(const c10::intrusive_ptr<c10d::Work>& work, c10d::OpType type) {
  if (type == c10d::OpType::SEND) return;                  // it reads its tensor only
  const std::vector<at::Tensor> written = work->result();  // the outputs, without waiting
  std::lock_guard<std::mutex> lock(pendingWritesMutex_);
  // Calls that ended go first: the list holds the calls still running.
  std::erase_if(pendingWrites_, [](const PendingWrite& p) {
    const c10::intrusive_ptr<c10d::Work> w = p.work.lock();
    return !w || w->isCompleted();
  });
  for (const at::Tensor& t : written) {
    if (t.defined() && t.has_storage()) {
      pendingWrites_.push_back({t.storage().unsafeGetStorageImpl(), TensorBytes::of(t),
                                c10::weak_intrusive_ptr<c10d::Work>(work)});
    }
  }
}

void ProcessGroupLoom::settle(const at::Tensor& read) const {
  // A completion callback on loom's own thread may be the end of the very call it would
  // wait for: it copies without waiting.
  if (Worker::current() != nullptr || !read.defined() || !read.has_storage()) return;
  const void* storage = read.storage().unsafeGetStorageImpl();
  // Only calls that write bytes this copy reads: a halo exchange sends a column of the
  // storage that a receive posted before it writes another column of (waiting for that
  // receive would wait for the peer's send, which waits for this one). Their byte ranges
  // interleave, so the bytes themselves are compared, not the extents.
  const TensorBytes bytes = TensorBytes::of(read);
  std::vector<c10::intrusive_ptr<c10d::Work>> writers;
  {
    std::lock_guard<std::mutex> lock(pendingWritesMutex_);
    for (const PendingWrite& p : pendingWrites_) {
      if (p.storage != storage || !shareBytes(p.bytes, bytes)) continue;
      if (c10::intrusive_ptr<c10d::Work> w = p.work.lock()) writers.push_back(std::move(w));
    }
  }
  for (const auto& w : writers) {
    if (w->isCompleted()) continue;
    try {
      releasingGil([&] { w->wait(); });
    } catch (...) {
      // Its failure is its own work's to report; this call goes on (and fails by itself if
      // the group has failed).
    }
  }
}

std::string ProcessGroupLoom::signatureOf(c10d::OpType type, const std::vector<at::Tensor>& inputs,
                                          const std::vector<at::Tensor>& outputs) const {
  // Only what every rank must pass alike: e.g. all_gather's input may differ in size
  // across ranks (uneven gathers) but its output list may not; all_to_all and point to
  // point shapes differ by design.
  using c10d::OpType;
  switch (type) {
    case OpType::BROADCAST:
    case OpType::ALLREDUCE:
    case OpType::ALLREDUCE_COALESCED:
    case OpType::REDUCE:
    case OpType::GATHER:
    case OpType::REDUCE_SCATTER: return "shapes " + shapesOf(inputs);
    case OpType::ALLGATHER:
    case OpType::ALLGATHER_COALESCED:
    case OpType::SCATTER: return "shapes " + shapesOf(outputs);
    case OpType::_ALLGATHER_BASE:
    case OpType::_REDUCE_SCATTER_BASE:
    case OpType::COALESCED: return "shapes " + shapesOf(inputs) + " -> " + shapesOf(outputs);
    default: return "";
  }
}

void ProcessGroupLoom::setTimeout(std::chrono::milliseconds timeout) {
  options_->timeout = timeout;
  translated([&] {
    comm_->setTimeout(timeout);
    return 0;
  });
}

at::Tensor ProcessGroupLoom::allocateTensor(long size, at::TensorOptions options) {
  // Messages as one ready string here: see invalid() (tensor_args.cc).
  const std::string called = "loom allocate_tensor (rank " + std::to_string(rank_) + "): ";
  TORCH_CHECK(size >= 0, called + "size must be >= 0, got " + std::to_string(size));
  // Other devices get what torch would allocate: supportsTensorAlloc answers true for a bare
  // "cuda" too (it sees only the index), and FSDP2 then asks here.
  if (options.has_device() && !options.device().is_cpu()) return at::empty({size}, options);
  const auto cpu = options.device(at::kCPU);
  const size_t itemSize = cpu.dtype().itemsize();
  TORCH_CHECK(static_cast<uint64_t>(size) <= (uint64_t{1} << 48) / itemSize,
              called + std::to_string(size) + " elements of " + std::to_string(itemSize) +
                  " bytes is more memory than any host has; ask for fewer");
  const size_t bytes = static_cast<size_t>(size) * itemSize;
  // Small buffers are never read in place (LOOM_LEND_BYTES), and a region each would cost a
  // descriptor each: they come from torch's allocator.
  if (bytes < kSmallestLent) return at::empty({size}, cpu);
  void* data = translated([&] { return shm::LendingPool::instance().allocate(bytes); });
  return at::from_blob(
      data, {size}, [](void* p) { shm::LendingPool::instance().release(p); }, cpu);
}

void ProcessGroupLoom::eagerConnectSingleDevice(at::Device device) {
  if (!device.is_cuda()) return;
  translated(
      [&] {
        releasingGil([&] { comm_->connectDevice(DeviceKind::kCuda, device.index()); });
        return 0;
      },
      ties_->legend);
}

void ProcessGroupLoom::startCoalescing() {
  bool open = false;
  {
    std::lock_guard<std::mutex> lock(coalesceMutex_);
    open = coalescing_;
  }
  if (open) {
    // torch's _coalescing_manager ends a block only if its body and the call it makes at the
    // end both succeed: after an error the block stays open. As NCCL does, the next block
    // starts anyway; the old one ends first, so what it holds is issued and released.
    TORCH_WARN("loom (rank " + std::to_string(rank_) +
               "): a coalescing block on this group was never ended (an error inside it?); it "
               "ends now, before the next one starts");
    try {
      endCoalescing();
    } catch (const std::exception&) {
      // That block's own error, reported when it happened.
    }
  }
  std::lock_guard<std::mutex> lock(coalesceMutex_);
  TORCH_CHECK(!coalescing_, "loom (rank " + std::to_string(rank_) +
                                "): startCoalescing raced another thread's on this group; start "
                                "blocks on one thread at a time");
  coalescing_ = true;
  coalesced_.clear();
  held_.clear();
  copyingBack_.clear();
  blockPruneAt_ = kBlockPruneFloor;
  blockError_ = nullptr;
  coalescedStream_.reset();
  blockTiming_.reset();
  comm_->startGroup();
}

void ProcessGroupLoom::forgetEndedInBlock() {
  // torch never ends a block whose body raised: it stays open until the group's next block
  // starts, and every call joins it. A program that goes on without another block would
  // otherwise keep every later call's requests and tensors. What failed stays, for the
  // block's work to report.
  if (coalesced_.size() + copyingBack_.size() < blockPruneAt_) return;
  std::erase_if(coalesced_, [](const Request& r) { return r.test() && !r.error(); });
  std::erase_if(copyingBack_, [](const c10::intrusive_ptr<WorkLoom>& w) {
    return w->isCompleted() && w->isSuccess();
  });
  blockPruneAt_ = std::max(kBlockPruneFloor, 2 * (coalesced_.size() + copyingBack_.size()));
}

void ProcessGroupLoom::markHeldEnds(std::vector<HeldFinish>& held) {
  // One mark per stream (the block's calls share the loom stream), after every copy-back:
  // each held call's own work's wait() orders the caller after it. Not in a capture: a mark
  // made there cannot be waited for after it, and the block's work orders the replay.
  std::vector<std::pair<c10::Stream, std::shared_ptr<const c10::Event>>> marks;
  for (HeldFinish& h : held) {
    auto mark = std::find_if(marks.begin(), marks.end(),
                             [&](const auto& m) { return m.first == h.stream; });
    if (mark == marks.end()) {
      if (capturing(h.stream)) continue;
      auto event = std::make_shared<c10::Event>(h.stream.device_type());
      event->record(h.stream);
      mark = marks.emplace(marks.end(), h.stream, std::move(event));
    }
    h.end->set(mark->second);
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::endCoalescing() {
  std::vector<Request> requests;
  std::vector<HeldFinish> held;
  std::vector<c10::intrusive_ptr<WorkLoom>> copyingBack;
  std::optional<c10::Stream> stream;
  std::optional<CallTiming> timing;
  std::exception_ptr refused;
  {
    std::lock_guard<std::mutex> lock(coalesceMutex_);
    TORCH_CHECK(coalescing_, "loom: endCoalescing called without startCoalescing");
    coalescing_ = false;
    requests.swap(coalesced_);
    held.swap(held_);
    copyingBack.swap(copyingBack_);
    stream.swap(coalescedStream_);
    timing.swap(blockTiming_);
    refused = std::exchange(blockError_, nullptr);
  }
  // A block of CUDA sends and receives alone is timed from here, where they are queued.
  if (stream && !timing && ties_->timing.load(std::memory_order_relaxed)) {
    timing.emplace(CallTiming::onStream(*stream));
  }
  // CUDA sends and receives are queued now, together; then their copy-backs.
  try {
    translated(
        [&] {
          releasingGil([&] { comm_->endGroup(); });
          return 0;
        },
        ties_->legend);
  } catch (...) {
    // What endGroup queued before it failed still runs: keep what it uses until it ends.
    for (HeldFinish& h : held) {
      abandonIssued(h.stream, h.uses, h.outputs, std::move(h.finisher), h.requests);
    }
    rejoinRefused(stream);  // a block that ends in an error leaves no work to join it
    throw;
  }
  for (HeldFinish& h : held) finishOnStream(h.stream, h.uses, h.outputs, h.finisher, h.requests);
  markHeldEnds(held);
  if (stream && timing) timing->queued(*stream);
  // An operation of the block was refused (heldInBlock): the ones issued run on, and the
  // caller learns why now, once torch's coalescing manager has closed its block.
  if (refused) {
    rejoinRefused(stream);
    std::rethrow_exception(refused);
  }
  // The operations were queued as they were called (CUDA transfers just now); this work
  // completes with the last, and on CUDA follows the stream semantics of its calls. A CPU
  // call's copy-back runs in its own work's completion, after its requests are marked done:
  // this work's finisher waits for those works (their errors become this work's). Where it
  // runs on the thread that ends the block's last request, every call's completion
  // callbacks for that request have already run there (they were registered first).
  std::function<void()> finisher;
  // A failed block runs no finisher, yet must not fail before its calls' copy-backs are
  // over: a request reads as ended just before its own work's callback copies back, and the
  // caller, told of the failure, may reuse the tensor that copy writes.
  std::function<void()> settle;
  if (!copyingBack.empty()) {
    settle = [copyingBack] {
      for (const auto& work : copyingBack) {
        try {
          work->wait();
        } catch (...) {  // its failure is the block's too: the finisher or the block says it
        }
      }
    };
    finisher = [copyingBack = std::move(copyingBack)] {
      for (const auto& work : copyingBack) work->wait();
    };
    if (stream) {  // CPU calls in a block of CUDA ones: a CUDA work has no host finisher
      releasingGil(finisher);
      finisher = nullptr;
      settle = nullptr;
    }
  }
  // Timed where the group timed its calls: a CUDA block from its first collective's start
  // (blockTiming_, begun in launch()) or from where its sends and receives were queued
  // (above), a CPU block on the host (CallTiming).
  const bool timed = ties_->timing.load(std::memory_order_relaxed);
  if (!stream && allEnded(requests)) {
    if (settle) releasingGil(settle);
    return c10::make_intrusive<FinishedWork>(rank_, c10d::OpType::COALESCED, "loom:coalesced",
                                             std::vector<at::Tensor>{}, c10::ArrayRef<at::Tensor>{},
                                             finisher, requests, *ties_, timed);
  }
  auto work = c10::make_intrusive<WorkLoom>(
      rank_, c10d::OpType::COALESCED, "loom:coalesced", "coalesced", std::vector<at::Tensor>{},
      std::vector<at::Tensor>{}, std::move(finisher), stream, stream ? events_ : nullptr);
  work->tieTo(ties_);
  if (settle) work->settleFirst(std::move(settle));
  if (stream && timing) {
    work->timeWith(std::move(*timing));
  } else if (timed && !stream) {
    work->timeWith(CallTiming(requests));
  }
  work->track(requests);
  return work;
}

uint64_t ProcessGroupLoom::globalRankOf(int r) const {
  const auto& global = options_->global_ranks_in_group;
  return global.empty() ? static_cast<uint64_t>(r) : global.at(static_cast<size_t>(r));
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupLoom::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  // Every rank of this group calls split; `ranks` are ranks of this group (sorted), and
  // non-members get nullptr. Members derive the child from this communicator; the store
  // (torch's, made for this split_group call) only tells calls apart.
  if (std::find(ranks.begin(), ranks.end(), rank_) == ranks.end()) return nullptr;
  std::lock_guard<std::mutex> lock(derivedMutex_);
  // torch's ask for the same split's next device type: one split_group passes every device
  // type's split the same store, made for that call alone (options and names can repeat
  // across calls, and on some ranks only). Making a second communicator there would cost a
  // second segment and worker, only for torch to drop it, as it keeps one backend per
  // backend type.
  if (lastSplit_.child && store && lastSplit_.store == store && lastSplit_.ranks == ranks) {
    if (auto child = lastSplit_.child->lock()) return child;
  }
  auto childOptions = c10::make_intrusive<Options>(opts ? opts->timeout : options_->timeout);
  if (opts) {
    childOptions->group_name = opts->group_name;
    childOptions->group_desc = opts->group_desc;
  }
  for (int r : ranks) childOptions->global_ranks_in_group.push_back(globalRankOf(r));
  // Not torch's name as the meeting key: split_group hashes the ranks with how many groups
  // this process knows, which differs between members that are in different earlier groups
  // (a 2-D device mesh after a new_group: each pair of the second dimension named its child
  // apart and waited for the other until the timeout). Its creation's errors name the
  // child's ranks: the child's legend maps them to global ranks.
  const std::string childLegend = legendOf(ranksOf(
      childOptions->group_name, childOptions->group_desc, childOptions->global_ranks_in_group));
  auto comm = translated([&] { return comm_->subset(ranks, "split", commOptions(*childOptions)); },
                         childLegend);
  c10::intrusive_ptr<c10d::Backend> child =
      c10::make_intrusive<ProcessGroupLoom>(std::move(comm), childOptions);
  lastSplit_ = {store, ranks, c10::weak_intrusive_ptr<c10d::Backend>(child)};
  return child;
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupLoom::merge(
    const c10::intrusive_ptr<c10d::Store>& store,
    const c10::intrusive_ptr<c10d::Backend::Options>& opts, const int& rank, const int& size) {
  std::lock_guard<std::mutex> lock(derivedMutex_);
  // torch's ask for this group's next device type: its new ProcessGroup holds the first.
  if (lastMerge_.merged && store && lastMerge_.store == store && lastMerge_.rank == rank &&
      lastMerge_.size == size) {
    if (auto merged = lastMerge_.merged->lock()) return merged;
  }
  auto options = c10::make_intrusive<Options>(opts ? opts->timeout : options_->timeout);
  if (opts) {
    options->group_name = opts->group_name;
    options->group_desc = opts->group_desc;
  }
  // A world of its own, joined through the caller's store, beside this group's world (which
  // new_group keeps subsetting). Its errors number its own ranks, 0 to size - 1: not with
  // this group's legend, which maps this group's ranks.
  // The engine's name for it is the same on every process: torch names a merged group
  // after each process's own group ("<its name>:merge"), and the processes that make one
  // communicator through a store must agree on its name (exchangeRoster).
  CommOptions engineOptions = commOptions(*options);
  engineOptions.name = "merge";
  auto comm = translated([&] {
    return Communicator::create(rank, size, std::make_shared<StoreAdapter>(store), engineOptions);
  });
  c10::intrusive_ptr<c10d::Backend> merged =
      c10::make_intrusive<ProcessGroupLoom>(std::move(comm), options);
  lastMerge_ = {store, rank, size, c10::weak_intrusive_ptr<c10d::Backend>(merged)};
  return merged;
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupLoom::shrink(
    const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
    const c10::intrusive_ptr<c10d::Backend::Options>& optsOverride) {
  constexpr int kShrinkAbort = 0x01;  // torch.distributed.SHRINK_ABORT
  const auto& from = optsOverride ? *optsOverride : static_cast<c10d::Backend::Options&>(*options_);
  auto childOptions = c10::make_intrusive<Options>(from.timeout);
  childOptions->group_name = from.group_name.empty() ? options_->group_name : from.group_name;
  childOptions->group_desc = from.group_desc;
  std::vector<int> excluded;
  for (int64_t r : ranksToExclude) {
    if (r < 0 || r >= size_) {
      invalid(site("shrink"), "rank " + std::to_string(r) +
                                  " in 'ranks_to_exclude' is outside [0, " + std::to_string(size_) +
                                  ")");
    }
    excluded.push_back(static_cast<int>(r));
  }
  for (int r = 0; r < size_; ++r) {
    if (std::find(excluded.begin(), excluded.end(), r) != excluded.end()) continue;
    // The world's ranks too: the child's messages then name each of its ranks' global rank,
    // the failure of its own creation included.
    childOptions->global_ranks_in_group.push_back(globalRankOf(r));
  }
  const std::string childLegend = legendOf(ranksOf(
      childOptions->group_name, childOptions->group_desc, childOptions->global_ranks_in_group));
  std::shared_ptr<Communicator> child;
  releasingGil([&] {
    // SHRINK_ABORT aborts once every argument is checked: a refused call leaves the group.
    child = translated(
        [&] {
          return comm_->shrink(excluded, commOptions(*childOptions),
                               (shrinkFlags & kShrinkAbort) != 0);
        },
        childLegend);
  });
  {
    // Shrinking the world makes the result the communicator later groups derive from.
    std::lock_guard<std::mutex> lock(gWorldMutex);
    if (gWorld.lock() == comm_) gWorld = child;
  }
  return c10::make_intrusive<ProcessGroupLoom>(std::move(child), childOptions);
}

void ProcessGroupLoom::abort() {
  comm_->abort();
  // Groups made later must not derive from an aborted world (torch's _abort_process_group()
  // and a world made anew, while something still holds this one), as after shutdown().
  std::lock_guard<std::mutex> lock(gWorldMutex);
  if (gWorld.lock() == comm_) gWorld.reset();
}

void ProcessGroupLoom::shutdown() {
  shutdownGroup(comm_, *ties_);
}

void ProcessGroupLoom::shutdownGroup(const std::shared_ptr<Communicator>& comm,
                                     const GroupTies& ties) {
  // Shutting down waits for the group's calls (as NCCL's does). A call whose work.wait(timeout)
  // expired, and that is still not done, would hold it until the call's own timeout (torch's
  // default: 30 minutes): the caller has given up on it, so it is aborted instead, and its
  // peers fail at once, naming this rank.
  if (ties.givenUp.load() > 0) comm->abort();
  {
    // Groups made later derive from the world only while it serves: after
    // destroy_process_group() a reference that survives keeps it alive, shut down, and a
    // world made anew (on another backend, say) must not be taken for it.
    std::lock_guard<std::mutex> lock(gWorldMutex);
    if (gWorld.lock() == comm) gWorld.reset();
  }
  releasingGil([&] { comm->shutdown(); });
}

}  // namespace loom::torch_plugin
