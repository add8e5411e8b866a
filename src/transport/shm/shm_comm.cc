// Phase counters, waits and the shared failure record.

#include "transport/shm/shm_comm.h"

#include <sched.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <thread>

#include "transport/shm/futex.h"

namespace loom::shm {

namespace {

std::string rankList(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) s += ", ";
    if (i == 8) {
      s += "and " + std::to_string(ranks.size() - 8) + " more";
      break;
    }
    s += std::to_string(ranks[i]);
  }
  return s;
}

}  // namespace

ShmComm::ShmComm(std::shared_ptr<Segment> segment, int rank, BackoffPolicy backoff)
    : segment_(std::move(segment)),
      base_(segment_->base()),
      layout_(segment_->layout()),
      header_(segment_->header()),
      lines_(reinterpret_cast<RankLine*>(base_ + layout_.rankLines)),
      rank_(rank),
      size_(layout_.size),
      backoff_(backoff) {}

void ShmComm::post(uint64_t phase) {
  RankLine& line = lines_[rank_];
  line.posted.store(phase, std::memory_order_release);
  // Pairs with the sleeper's increment-then-recheck in slowWait: either the sleeper sees the
  // new value before sleeping, or we see its increment here and wake it.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (line.sleepers.load(std::memory_order_relaxed) != 0) futexWakeAll(lowWord(&line.posted));
  if (phase == killPhase_) ::raise(SIGKILL);  // fault injection; killPhase_ is 0 normally
}

void ShmComm::attachSelf(int pid) {
  lines_[rank_].pid = pid;
  lines_[rank_].state.store(static_cast<uint32_t>(RankState::kAlive), std::memory_order_release);
}

void ShmComm::depart() {
  lines_[rank_].state.store(static_cast<uint32_t>(RankState::kDeparted), std::memory_order_release);
  wakeAll();
}

void ShmComm::markDead(int q) {
  auto expected = static_cast<uint32_t>(RankState::kAlive);
  if (lines_[q].state.compare_exchange_strong(expected, static_cast<uint32_t>(RankState::kDead),
                                              std::memory_order_acq_rel)) {
    // Fail the whole communicator, not only waits on q: a rank waiting for a live peer that
    // itself waits for q (in a receive, or behind in an earlier collective) must learn of it
    // too, or it would wait until its timeout.
    fail(ErrorCode::kPeerFailure, q,
         "rank " + std::to_string(q) + " (pid " + std::to_string(lines_[q].pid) +
             ") exited without leaving the communicator; restart the job or rebuild the group "
             "without it");
  }
  wakeAll();
}

void ShmComm::peerGone(int q, RankState state, const WaitSpec& spec) {
  std::string message = std::string(spec.op) + " #" + std::to_string(spec.seq) + ": rank " +
                        std::to_string(q) + " (pid " + std::to_string(lines_[q].pid) + ")";
  if (state == RankState::kDead) {
    fail(ErrorCode::kPeerFailure, q,
         message + " exited while rank " + std::to_string(rank_) +
             " was waiting for it; restart the job or rebuild the group without it");
  } else {
    fail(ErrorCode::kMismatch, q,
         message +
             " had already destroyed its communicator, so it issued fewer collectives "
             "than rank " +
             std::to_string(rank_));
  }
  throw failureError(spec.op);
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
    if (failed()) throw failureError(spec.op);
    const auto state = static_cast<RankState>(line.state.load(std::memory_order_acquire));
    if (state != RankState::kAlive) {
      // Its last post may have landed just before it left: look once more.
      if (line.posted.load(std::memory_order_acquire) >= phase) return;
      peerGone(q, state, spec);
    }
    switch (backoff.next()) {
      case Backoff::Stage::kSpin: cpuRelax(); break;
      case Backoff::Stage::kYield: sched_yield(); break;
      case Backoff::Stage::kSleep: {
        const auto now = std::chrono::steady_clock::now();
        if (now >= spec.deadline) timeOut(phase, spec);
        line.sleepers.fetch_add(1, std::memory_order_seq_cst);
        const uint64_t seen = line.posted.load(std::memory_order_seq_cst);
        if (seen < phase && !failed()) {
          const auto slice =
              std::min<std::chrono::nanoseconds>(backoff_.sleepSlice, spec.deadline - now);
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

void ShmComm::timeOut(uint64_t phase, const WaitSpec& spec) {
  const std::vector<int> missing = laggards(phase);
  // Where each laggard is tells behind (finished an earlier collective, never issued this
  // one) from stuck (started one and is waiting inside it).
  std::string where;
  for (size_t i = 0; i < missing.size() && i < 4; ++i) {
    const Progress p = progressOf(missing[i]);
    where += (i == 0 ? "; " : ", ") + std::string("rank ") + std::to_string(missing[i]) +
             (p.started == 0
                  ? " has started no collective"
                  : " last started #" + std::to_string(p.started) +
                        (p.finished >= p.started ? " and finished it" : " and is still in it"));
  }
  std::string message = std::string(spec.op) + " #" + std::to_string(spec.seq) +
                        " hit its timeout of " + std::to_string(spec.timeout.count()) +
                        " ms: rank(s) " + rankList(missing) +
                        " had not arrived (they are behind, stuck in other work, or issued "
                        "a different sequence of collectives)" +
                        where;
  fail(ErrorCode::kTimeout, missing.empty() ? -1 : missing.front(), message);
  throw failureError(spec.op);
}

void ShmComm::fail(ErrorCode code, int culprit, std::string_view message) {
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

Error ShmComm::failureError(std::string_view op) const {
  const FailureRecord& record = header_.failure;
  // The reporter may still be writing the record; give it a moment.
  for (int i = 0; i < 100000 && record.state.load(std::memory_order_acquire) == 1; ++i) {
    if (i > 100) std::this_thread::yield();
  }
  if (record.state.load(std::memory_order_acquire) != 2) {
    return Error(ErrorCode::kPeerFailure, op, rank_,
                 "the communicator failed (a rank died while recording why)");
  }
  const auto code = static_cast<ErrorCode>(record.code);
  std::string detail(record.message);
  if (record.reporter != rank_) {
    detail = "the communicator failed on rank " + std::to_string(record.reporter) + ": " + detail;
  }
  return Error(code, op, rank_, detail);
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
