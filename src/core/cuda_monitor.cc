// The CUDA executor's monitor thread: it completes queued calls from their events, and turns
// what goes wrong (a peer's mismatch report, a dead or departed peer, a deadline, abort) into
// the communicator's failure, releasing every kernel that waits on a peer. The executor's
// set-up, workspaces and queueing are in cuda_executor.cc.

#include <algorithm>
#include <array>
#include <string>
#include <thread>
#include <vector>

#include "core/cuda_descriptors.h"
#include "core/cuda_executor.h"
#include "core/cuda_workspace.h"
#include "cuda/driver.h"
#include "loom/error.h"

namespace loom::detail {

namespace {

using Clock = std::chrono::steady_clock;
using cuda::Driver;

// A value above any epoch: written into every flag to release waits when the
// communicator fails (waits compare as (int64_t)(flag - epoch) >= 0).
constexpr uint64_t kReleased = uint64_t{1} << 62;
// How long a call whose kernels found a peer's stopped ones waits for that peer's failure.
constexpr auto kStaleGrace = std::chrono::seconds(1);
// How often the monitor looks for failures with nothing queued, and how often it releases
// the flags again while failed calls are still on the GPU.
constexpr auto kIdlePoll = std::chrono::milliseconds(10);
constexpr auto kReleaseEvery = std::chrono::milliseconds(2);
// How often the monitor looks for a peer that left behind this rank's steps.
constexpr auto kLeftEvery = std::chrono::milliseconds(10);
// With graphs captured and nothing queued, a failed communicator's flags are released again
// at doubling intervals, up to this (a replay's streams are not tracked).
constexpr auto kGraphReleaseMost = std::chrono::milliseconds(1000);

}  // namespace

void CudaExecutor::release() {
  const Clock::time_point now = Clock::now();
  if (lastRelease_ != Clock::time_point{} && now - lastRelease_ < kReleaseEvery) return;
  lastRelease_ = now;
  const Driver& d = Driver::get();
  auto write = [&](uint8_t* word, uint64_t value) {
    d.cuStreamWriteValue64(abortStream_, reinterpret_cast<CUdeviceptr>(word), value,
                           CU_STREAM_WRITE_VALUE_DEFAULT);
  };
  // Every rank's abort word first (their kernels still queued skip their work, and none
  // reads a slot or a descriptor that a released wait let it reach early), then every flag.
  for (uint8_t* base : bases_) write(base + kAbortOffset, 1);
  for (int q = 0; q < size_; ++q) {
    for (const Lane* lane : {&eager_, &graph_}) {
      for (int f = kReady; f <= kDone; ++f) {
        write(bases_[q] + lane->flagsAt + f * kFlagStride, kReleased);
        write(bases_[q] + lane->oddFlagsAt + f * kFlagStride, kReleased);
      }
      for (int peer = 0; peer < size_; ++peer) {
        uint8_t* block = bases_[q] + lane->pairsAt + static_cast<size_t>(peer) * kPairStride;
        write(block + kSent * kFlagStride, kReleased);
        write(block + kTaken * kFlagStride, kReleased);
      }
    }
  }
}

void CudaExecutor::reportMismatch() {
  std::atomic_thread_fence(std::memory_order_acquire);
  const cuda::MismatchReport& r = *reportHost_;
  const std::string peer = "rank " + std::to_string(r.peer);
  const std::string self = "rank " + std::to_string(rank_);
  const auto what = static_cast<uint8_t>(r.mine.words[0]);
  std::string message;
  if (staleStep(r.mine, r.theirs)) {
    // The peer's kernels stopped (its communicator failed) before this step: its own
    // failure, told through the failure domain, is the one to report. Given a moment to
    // arrive, it is; meanwhile the calls that found this wait (monitor()).
    const Clock::time_point now = Clock::now();
    if (!staleSince_) staleSince_ = now;
    if (now - *staleSince_ < kStaleGrace) return;
    failures_.fail(ErrorCode::kPeerFailure, r.peer,
                   "on CUDA tensors, " + peer + " did not take part in " + explain(r.mine) +
                       " (its kernels had stopped, as they do once its communicator fails), "
                       "and no failure of " +
                       peer + " reached " + self + "; see " + peer + "'s error");
    return;
  }
  if (what == kSendRecv || what == kAllToAllBlock) {
    message = "on CUDA tensors, " + peer + "'s next message to " + self + " is " +
              explain(r.theirs) + ", but " + self + " is receiving " + explain(r.mine) +
              " from it; a pair's sends and receives on CUDA tensors match in the order they "
              "are issued (as with NCCL), so issue them in the same order and sizes on both";
    // Fused and stepped transfers cut messages alike but signal differently.
    if ((r.theirs.words[0] ^ r.mine.words[0]) & kFusedBit) {
      const auto how = [&](const cuda::Descriptor& d) {
        return std::string(d.words[0] & kFusedBit ? "a fused kernel" : "the stepped path");
      };
      message += "; and " + peer + " moves its messages with " + how(r.theirs) + ", " + self +
                 " with " + how(r.mine) +
                 ": LOOM_CUDA_FUSED and LOOM_CUDA_CHUNK_BYTES must be the same on every rank";
    }
  } else {
    message = collectiveMismatch(r.peer, rank_, r.theirs, r.mine);
  }
  failures_.fail(ErrorCode::kMismatch, r.peer, message);
}

std::vector<uint64_t> CudaExecutor::lastSteps(const Lane& lane) {
  // Read on loom's own stream, which no caller's stream holds up.
  const Driver& d = Driver::get();
  std::vector<std::array<uint64_t, 2>> ready(static_cast<size_t>(size_));
  bool read = true;
  for (int q = 0; q < size_ && read; ++q) {
    for (int parity = 0; parity < 2 && read; ++parity) {
      const size_t at = (parity ? lane.oddFlagsAt : lane.flagsAt) + kReady * kFlagStride;
      read = d.cuMemcpyDtoHAsync(&ready[q][parity], reinterpret_cast<CUdeviceptr>(bases_[q] + at),
                                 sizeof(uint64_t), abortStream_) == CUDA_SUCCESS;
    }
  }
  // Synchronized whatever happened: no copy may still be writing into `ready` after this.
  if (d.cuStreamSynchronize(abortStream_) != CUDA_SUCCESS || !read) return {};
  std::vector<uint64_t> last(static_cast<size_t>(size_));
  for (int q = 0; q < size_; ++q) last[q] = std::max(ready[q][0], ready[q][1]);
  return last;
}

void CudaExecutor::failIfPeerLeft() {
  const Clock::time_point now = Clock::now();
  if (now - leftChecked_ < kLeftEvery) return;
  leftChecked_ = now;
  std::vector<int> left;
  for (int q = 0; q < size_; ++q) {
    if (q != rank_ && failures_.stateOf(q) == RankState::kDeparted) left.push_back(q);
  }
  if (left.empty()) return;
  // A rank that shut down had finished every call it issued (shutdown waits for them), so
  // it took its part in every step it reached; a step of this rank's beyond its last one
  // waits for it in vain. (The graph lane numbers its steps alike on every rank that
  // replays the same captures.)
  for (const Lane* lane : {&eager_, &graph_}) {
    if (lane == &graph_ && !graphsCaptured_) continue;
    const std::vector<uint64_t> last = lastSteps(*lane);
    if (last.empty()) return;
    for (int q : left) {
      if (last[q] >= last[rank_]) continue;
      failures_.fail(ErrorCode::kMismatch, q,
                     "on CUDA tensors, rank " + std::to_string(q) +
                         " had already destroyed its communicator, so it issued fewer "
                         "collectives than rank " +
                         std::to_string(rank_) +
                         (lane == &graph_ ? " (in replays of captured calls)" : "") +
                         ": its last step was " + std::to_string(last[q]) + ", rank " +
                         std::to_string(rank_) + "'s is " + std::to_string(last[rank_]));
      return;
    }
  }
  // A replay's wait has no deadline, and its sends and receives take no steps.
  if (graphsCaptured_) {
    if (const std::optional<ReplayWait> stuck = replayWaitingOn(left)) {
      failures_.fail(ErrorCode::kPeerFailure, stuck->peer,
                     "on CUDA tensors, rank " + std::to_string(stuck->peer) +
                         " had already destroyed its communicator, so a replay of a captured "
                         "call waits for it in vain (" +
                         stuck->what + ")");
      return;
    }
  }
  // Sends and receives take no steps: their chunks are counted per pair instead.
  for (int q : left) {
    const std::string missing = transfersLeftBy(q);
    if (missing.empty()) continue;
    failures_.fail(ErrorCode::kPeerFailure, q,
                   "on CUDA tensors, rank " + std::to_string(q) +
                       " had already destroyed its communicator, so " + missing);
    return;
  }
}

std::optional<CudaExecutor::ReplayWait> CudaExecutor::replayWaitingOn(
    const std::vector<int>& left) {
  const Driver& d = Driver::get();
  std::array<uint64_t, 2> record{};  // the flag's address, the value awaited
  const auto at = reinterpret_cast<CUdeviceptr>(bases_[rank_] + kGraphWaitOffset);
  // The address first, in stream order: its value was written before it (loom_flags).
  bool read = d.cuMemcpyDtoHAsync(&record[0], at, sizeof(uint64_t), abortStream_) == CUDA_SUCCESS &&
              d.cuMemcpyDtoHAsync(&record[1], at + sizeof(uint64_t), sizeof(uint64_t),
                                  abortStream_) == CUDA_SUCCESS;
  if (d.cuStreamSynchronize(abortStream_) != CUDA_SUCCESS || !read) return std::nullopt;
  // The same record twice in a row, kLeftEvery apart: not one the kernel was rewriting, nor a
  // wait that ended between the two.
  const bool steady = record == replayWaitSeen_;
  replayWaitSeen_ = record;
  if (record[0] == 0 || !steady) return std::nullopt;
  for (int q : left) {
    const auto base = reinterpret_cast<uint64_t>(bases_[q]);
    if (record[0] < base + kGraphOffset || record[0] >= base + kDataOffset) continue;
    uint64_t value = 0;
    read = d.cuMemcpyDtoHAsync(&value, static_cast<CUdeviceptr>(record[0]), sizeof value,
                               abortStream_) == CUDA_SUCCESS;
    if (d.cuStreamSynchronize(abortStream_) != CUDA_SUCCESS || !read) return std::nullopt;
    // A departed rank finished every call it issued: its flags move no more.
    if (static_cast<int64_t>(value - record[1]) >= 0) return std::nullopt;
    const uint64_t pairAt = base + graph_.pairsAt + static_cast<uint64_t>(rank_) * kPairStride;
    const char* what = record[0] == pairAt + kSent * kFlagStride    ? "a receive from it"
                       : record[0] == pairAt + kTaken * kFlagStride ? "a send to it"
                                                                    : "a collective step";
    return ReplayWait{q, what};
  }
  return std::nullopt;
}

std::string CudaExecutor::transfersLeftBy(int q) {
  // Its final counts: a word that says they are written, then sent to and taken from each
  // rank (leaveFinalCounts; the workspace stays mapped here after its process let it go).
  const Driver& d = Driver::get();
  std::vector<uint64_t> finals(1 + 2 * static_cast<size_t>(size_));
  const bool read =
      d.cuMemcpyDtoHAsync(finals.data(),
                          reinterpret_cast<CUdeviceptr>(bases_[q] + kFinalCountsOffset),
                          finals.size() * sizeof(uint64_t), abortStream_) == CUDA_SUCCESS;
  if (d.cuStreamSynchronize(abortStream_) != CUDA_SUCCESS || !read || finals[0] == 0) return {};
  const uint64_t tookFromHere = finals[1 + 2 * static_cast<size_t>(rank_) + 1];
  const uint64_t sentHere = finals[1 + 2 * static_cast<size_t>(rank_)];
  const std::string r = "rank " + std::to_string(rank_);
  // Only chunks of calls still queued count: a finished send of at most two chunks went into
  // its mailbox whether or not it was ever taken, and fails nothing now.
  if (issuedSent_[q] > tookFromHere && issuedSent_[q] > finishedSent_[q]) {
    return "it never takes what " + r + " sends it (it took " + std::to_string(tookFromHere) +
           " chunks from " + r + "; " + r + "'s sends to it have " +
           std::to_string(issuedSent_[q]) + ")";
  }
  if (issuedTaken_[q] > sentHere && issuedTaken_[q] > finishedTaken_[q]) {
    return "it never sends what " + r + " receives from it (it sent " + std::to_string(sentHere) +
           " chunks to " + r + "; " + r + "'s receives from it wait for " +
           std::to_string(issuedTaken_[q]) + ")";
  }
  return {};
}

void CudaExecutor::leaveFinalCounts() noexcept {
  // Every call has finished: the eager lane's counts are what this rank ever took part in.
  // The counts go first, then the word that says they are there (peers read them only
  // once this rank has departed, after this returned, but a torn read must not count).
  std::vector<uint64_t> counts(2 * static_cast<size_t>(size_));
  for (int q = 0; q < size_; ++q) {
    counts[2 * static_cast<size_t>(q)] = eager_.sent[static_cast<size_t>(q)];
    counts[2 * static_cast<size_t>(q) + 1] = eager_.taken[static_cast<size_t>(q)];
  }
  const Driver& d = Driver::get();
  const auto at = reinterpret_cast<CUdeviceptr>(bases_[rank_] + kFinalCountsOffset);
  const uint64_t written = 1;
  if (d.cuMemcpyHtoDAsync(at + sizeof(uint64_t), counts.data(), counts.size() * sizeof(uint64_t),
                          abortStream_) == CUDA_SUCCESS &&
      d.cuStreamSynchronize(abortStream_) == CUDA_SUCCESS) {
    d.cuMemcpyHtoDAsync(at, &written, sizeof(written), abortStream_);
  }
  d.cuStreamSynchronize(abortStream_);  // `counts` and `written` live no longer than this
}

std::string CudaExecutor::lateness(const Pending& late) {
  const std::string unknown = "some rank has not issued it, or its GPU is stuck";
  if (late.firstStep == 0) return unknown;
  // Each peer's last step, as its "ready" flags of both parities say.
  const std::vector<uint64_t> last = lastSteps(eager_);
  if (last.empty()) return unknown;
  std::string behind;
  int named = 0;
  int more = 0;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    if (last[q] >= late.firstStep) continue;
    if (named == 8) {  // the failure record holds a few hundred characters
      ++more;
      continue;
    }
    behind += (behind.empty() ? "" : ", ") + std::string("rank ") + std::to_string(q) +
              " (its last step " + std::to_string(last[q]) + ")";
    ++named;
  }
  if (more > 0) behind += " and " + std::to_string(more) + " more";
  if (behind.empty()) {
    return "every rank has started it (this call's first step is " +
           std::to_string(late.firstStep) + "), so a GPU may be stuck, or held by other work";
  }
  return "not yet reached by " + behind + ", where this call's first step is " +
         std::to_string(late.firstStep) +
         ": those ranks have not issued it (or an earlier call of theirs is held up)";
}

void CudaExecutor::drain() {
  const Driver& d = Driver::get();
  if (draining_.empty()) return;
  std::erase_if(draining_, [&](CUevent event) {
    if (d.cuEventQuery(event) == CUDA_ERROR_NOT_READY) return false;
    spareEvents_.push_back(event);
    return true;
  });
  // A stream still behind may have written its own flags after the last release (every
  // flag write sets a value), holding a later wait of a peer's, or of this rank's: the
  // flags are released again until every failed call has left the GPU.
  if (!draining_.empty()) release();
  if (draining_.empty()) pendingChanged_.notify_all();
}

void CudaExecutor::monitor() {
  const Driver& d = Driver::get();
  cuda::ContextGuard guard(context_);
  cuda::RelaxedCaptureGuard relaxed;  // polls while the caller's thread may be capturing
  // Poll often while a collective is young (its request completes within microseconds of
  // its event), every 100 us once it has run for half a millisecond.
  Clock::time_point since = Clock::now();
  std::unique_lock<std::mutex> lock(pendingMutex_);
  while (true) {
    drain();
    if (pending_.empty()) {
      if (stopping_) return;
      pendingChanged_.wait_for(lock, draining_.empty() ? kIdlePoll : kReleaseEvery,
                               [this] { return stopping_ || !pending_.empty(); });
      // With nothing queued, replays of captured calls may still be running: a mismatch one
      // of them found, a dead peer or an abort must release them too (and again, as long
      // as the executor lives: a replay's streams are not tracked here).
      if (reportHost_->raised != 0 && !failures_.failed()) reportMismatch();
      if (graphsCaptured_ && !failures_.failed()) failIfPeerLeft();
      if (failures_.failed() &&
          (lastRelease_ == Clock::time_point{} ||
           (graphsCaptured_ && Clock::now() - lastRelease_ >= graphRelease_))) {
        release();
        // Replays still behind are released within the first tries; after that, rarely.
        graphRelease_ = std::min<std::chrono::milliseconds>(2 * graphRelease_, kGraphReleaseMost);
      }
      since = Clock::now();
      continue;
    }
    Pending& first = pending_.front();  // one stream per enqueue order: finish in order
    const CUresult state = d.cuEventQuery(first.event);
    // After the query: a kernel's report is visible once the event behind it has fired. A
    // kernel that found a mismatch did nothing, so its call must not succeed. (Its later
    // steps, on loom's second stream, may have run before the abort word was set: a failed
    // call's outputs are undefined, as with NCCL.)
    const bool reported = reportHost_->raised != 0;
    if (reported && !failures_.failed()) reportMismatch();
    if (state == CUDA_ERROR_NOT_READY && !failures_.failed()) failIfPeerLeft();
    std::exception_ptr failure;
    // A report not yet a failure (a peer's stopped kernels, given time for its own failure
    // to arrive): the call waits for it, never succeeding on work its kernels skipped.
    const bool held = state == CUDA_SUCCESS && reported && !failures_.failed();
    bool finished = state == CUDA_SUCCESS && !held;
    if (state != CUDA_SUCCESS && state != CUDA_ERROR_NOT_READY) {
      failure = std::make_exception_ptr(
          Error(ErrorCode::kSystem, first.op, rank_,
                "the GPU reported an error while running it (a fault in a kernel before it, "
                "or the device was lost); see the CUDA error from PyTorch"));
      finished = true;
    } else if (failures_.failed() || (!finished && !held && Clock::now() >= first.deadline)) {
      if (!failures_.failed()) {
        failures_.fail(
            ErrorCode::kTimeout, -1,
            first.op + " on CUDA tensors did not finish within its timeout: " + lateness(first));
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
    if (!done.sentAfter.empty()) {
      finishedSent_ = std::move(done.sentAfter);
      finishedTaken_ = std::move(done.takenAfter);
    }
    lock.unlock();
    for (const auto& state : done.states) state->complete(failure);
    since = Clock::now();
    lock.lock();
    // Failed before its event fired: its kernels, released, are still on the GPU, reading
    // workspaces the destructor must not unmap before they are done.
    if (state == CUDA_ERROR_NOT_READY) {
      draining_.push_back(done.event);
    } else {
      spareEvents_.push_back(done.event);
    }
    pendingChanged_.notify_all();
  }
}

}  // namespace loom::detail
