// Phase counters, waits and the shared failure record.

#include "transport/shm/shm_comm.h"

#include <sched.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <thread>

#include "util/futex.h"
#include "util/trace.h"

namespace loom::shm {

ShmComm::ShmComm(std::shared_ptr<Segment> segment, int rank, BackoffPolicy backoff,
                 std::vector<int> ranks)
    : segment_(std::move(segment)),
      base_(segment_->base()),
      layout_(segment_->layout()),
      header_(segment_->header()),
      lines_(reinterpret_cast<RankLine*>(base_ + layout_.rankLines)),
      rank_(rank),
      ranks_(std::move(ranks)),
      size_(layout_.size),
      backoff_(backoff),
      lentMappings_(layout_.size) {
  if (ranks_.empty()) {
    for (int q = 0; q < size_; ++q) ranks_.push_back(q);
  }
}

void ShmComm::post(uint64_t phase) {
  RankLine& line = lines_[rank_];
  line.posted.store(phase, std::memory_order_release);
  // Pairs with the sleeper's increment-then-recheck in slowWait: either the sleeper sees the
  // new value before sleeping, or we see its increment here and wake it.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (line.sleepers.load(std::memory_order_relaxed) != 0) futexWakeAll(lowWord(&line.posted));
  // Fault injection; both phases are 0 normally.
  if (phase == kill_.phase) ::raise(SIGKILL);
  if (phase == stall_.phase) std::this_thread::sleep_for(stallFor_);
}

void ShmComm::attachSelf(int pid) {
  lines_[rank_].pid = pid;
  lines_[rank_].state.store(static_cast<uint32_t>(RankState::kAlive), std::memory_order_release);
}

void ShmComm::depart() {
  lines_[rank_].state.store(static_cast<uint32_t>(RankState::kDeparted), std::memory_order_release);
  wakeAll();
}

bool ShmComm::markDead(int q) {
  auto expected = static_cast<uint32_t>(RankState::kAlive);
  const bool changed = lines_[q].state.compare_exchange_strong(
      expected, static_cast<uint32_t>(RankState::kDead), std::memory_order_acq_rel);
  return changed;
}

void ShmComm::waitAll(uint64_t phase, const WaitSpec& spec) {
  for (int q = 0; q < size_; ++q) {
    if (q != rank_) waitPeer(q, phase, spec);
  }
  allPosted_ = std::max(allPosted_, phase);
}

void ShmComm::slowWait(int q, uint64_t phase, const WaitSpec& spec) {
  RankLine& line = lines_[q];
  Backoff backoff(backoff_);
  for (;;) {
    if (line.posted.load(std::memory_order_acquire) >= phase) return;
    if (failed()) throw failures_->failureError(spec.op);
    const auto state = static_cast<RankState>(line.state.load(std::memory_order_acquire));
    if (state != RankState::kAlive) {
      // Its last post may have landed just before it left: look once more.
      if (line.posted.load(std::memory_order_acquire) >= phase) return;
      failures_->peerGone(ranks_[q], state, spec);
    }
    switch (backoff.next()) {
      case Backoff::Stage::kSpin: cpuRelax(); break;
      case Backoff::Stage::kYield: sched_yield(); break;
      case Backoff::Stage::kSleep: {
        const auto now = std::chrono::steady_clock::now();
        if (now >= spec.deadline) {
          // Posted since the check above, just as the time ran out: arrived, not late (a
          // timeout now would fail the communicator naming no laggard).
          if (line.posted.load(std::memory_order_acquire) >= phase) return;
          failures_->timedOut(phase, spec);
        }
        line.sleepers.fetch_add(1, std::memory_order_seq_cst);
        const uint64_t seen = line.posted.load(std::memory_order_seq_cst);
        if (seen < phase && !failed()) {
          const auto slice =
              std::min<std::chrono::nanoseconds>(backoff_.sleepSlice, spec.deadline - now);
          // LOOM_TRACE: a wait that outlasted spinning and yielding; its wake-up is the
          // scheduler's, so python -m loom.trace counts the calls that had one.
          const trace::Span asleep("asleep", phase);
          futexWait(lowWord(&line.posted), static_cast<uint32_t>(seen), slice);
        }
        line.sleepers.fetch_sub(1, std::memory_order_relaxed);
        break;
      }
    }
  }
}

std::vector<int> ShmComm::laggards(uint64_t phase) const {
  std::vector<int> ranks;
  for (int q = 0; q < size_; ++q) {
    if (lines_[q].posted.load(std::memory_order_acquire) < phase) ranks.push_back(q);
  }
  return ranks;
}

void ShmComm::recordFailure(ErrorCode code, int culprit, std::string_view message) {
  FailureRecord& record = header_.failure;
  uint32_t expected = 0;
  if (record.state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    record.code = static_cast<int32_t>(code);
    record.reporter = rank_;
    record.culprit = culprit;
    const size_t n = std::min(message.size(), sizeof record.message - 1);
    std::memcpy(record.message, message.data(), n);
    record.message[n] = '\0';
    record.state.store(2, std::memory_order_release);
  }
  wakeAll();
}

ShmComm::RecordedFailure ShmComm::recordedFailure() const {
  const FailureRecord& record = header_.failure;
  // The reporter may still be writing the record; give it a moment.
  for (int i = 0; i < 100000 && record.state.load(std::memory_order_acquire) == 1; ++i) {
    if (i > 100) std::this_thread::yield();
  }
  RecordedFailure recorded;
  if (record.state.load(std::memory_order_acquire) != 2) return recorded;
  recorded.complete = true;
  recorded.code = static_cast<ErrorCode>(record.code);
  recorded.reporter = record.reporter;
  recorded.culprit = record.culprit;
  recorded.message.assign(record.message, ::strnlen(record.message, sizeof record.message));
  return recorded;
}

void ShmComm::ringDoorbell(int q) {
  Doorbell& bell = doorbell(q);
  bell.rings.fetch_add(1, std::memory_order_seq_cst);
  if (bell.sleeping.load(std::memory_order_seq_cst) != 0) futexWakeAll(&bell.rings);
}

void ShmComm::sleepOnDoorbell(uint32_t seen, std::chrono::nanoseconds slice) {
  // Pairs with ringDoorbell: either the ringer sees `sleeping` and wakes us, or we see its
  // new count here and do not sleep.
  Doorbell& bell = doorbell(rank_);
  bell.sleeping.store(1, std::memory_order_seq_cst);
  if (bell.rings.load(std::memory_order_seq_cst) == seen) {
    futexWait(&bell.rings, seen, slice);
  }
  bell.sleeping.store(0, std::memory_order_relaxed);
}

void ShmComm::wakeAll() {
  for (int q = 0; q < size_; ++q) {
    futexWakeAll(lowWord(&lines_[q].posted));
    Doorbell& bell = doorbell(q);
    bell.rings.fetch_add(1, std::memory_order_release);
    futexWakeAll(&bell.rings);
  }
}

}  // namespace loom::shm
