// What failures say, and the report an operator reads.

#include "core/failure_domain.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "algorithms/collective.h"
#include "core/flight_recorder.h"
#include "core/op_state.h"
#include "util/env.h"
#include "util/posix.h"

namespace loom::detail {

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

const char* rankStateName(RankState state) {
  switch (state) {
    case RankState::kAlive: return "alive";
    case RankState::kDeparted: return "left";
    case RankState::kDead: return "DEAD";
  }
  return "?";
}

// The failure's loom error code, if it is a loom::Error.
std::optional<ErrorCode> codeOf(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const Error& e) {
    return e.code();
  } catch (...) {
    return std::nullopt;
  }
}

// How many flight-record entries a report on stderr shows; a dump file gets them all.
constexpr size_t kReportedEntries = 20;

// Appends `text` to the file at `path`, making its folder first (as LOOM_TRACE does); the
// reason it could not, or nothing. (C stdio, not a stream: see tests/lint/check_messages.py.)
std::optional<std::string> appendToFile(const std::string& path, const std::string& text) {
  FILE* file = posix::openMakingFolder(path, "a");
  if (file == nullptr) return std::string(std::strerror(errno));
  const bool written = std::fwrite(text.data(), 1, text.size(), file) == text.size();
  const int writeErrno = errno;
  if (std::fclose(file) != 0 || !written) {
    return std::string(std::strerror(written ? errno : writeErrno));
  }
  return std::nullopt;
}

}  // namespace

FailureDomain::FailureDomain(shm::ShmComm& shm, std::string name, std::string rankLegend, int rank,
                             const Roster& roster, const HostMap& hosts)
    : shm_(shm),
      name_(std::move(name)),
      rankLegend_(std::move(rankLegend)),
      rank_(rank),
      roster_(roster),
      hosts_(hosts),
      remote_(new std::atomic<uint8_t>[roster.peers.size()]) {
  for (size_t q = 0; q < roster.peers.size(); ++q) remote_[q].store(0);
}

std::string FailureDomain::describe(int q) const {
  if (!onThisHost(q)) return describeRemote(roster_, q);
  return "rank " + std::to_string(q) + " (pid " + std::to_string(shm_.pidOf(local(q))) + ")";
}

RankState FailureDomain::stateOf(int q) const {
  if (onThisHost(q)) return shm_.stateOf(local(q));
  return static_cast<RankState>(remote_[q].load(std::memory_order_acquire));
}

void FailureDomain::peerLeft(int q) {
  uint8_t alive = static_cast<uint8_t>(RankState::kAlive);
  remote_[q].compare_exchange_strong(alive, static_cast<uint8_t>(RankState::kDeparted));
}

void FailureDomain::noteGoodbye(int q) {
  // In the host's segment: only the host's rail ranks hold control links, and any rank here
  // may be the one whose send or receive waits on q over a link q never made.
  shm_.goodbye(q).store(1, std::memory_order_release);
}

bool FailureDomain::saidGoodbye(int q) const {
  return shm_.goodbye(q).load(std::memory_order_acquire) != 0;
}

void FailureDomain::peerLost(int q, std::string_view why) {
  if (onThisHost(q)) {
    fail(ErrorCode::kPeerFailure, q, describe(q) + ": " + std::string(why));
    return;
  }
  remote_[q].store(static_cast<uint8_t>(RankState::kDead), std::memory_order_release);
  fail(ErrorCode::kPeerFailure, q,
       "lost " + describe(q) + ": " + std::string(why) +
           "; restart the job or rebuild the group without it");
}

void FailureDomain::fail(ErrorCode code, int culprit, std::string_view message) {
  shm_.recordFailure(code, culprit, message);
}

Error FailureDomain::failureError(std::string_view op) const {
  const shm::ShmComm::RecordedFailure record = shm_.recordedFailure();
  if (!record.complete) {
    return Error(ErrorCode::kPeerFailure, op, rank_,
                 "the communicator failed (a rank died while recording why)");
  }
  std::string detail = record.message;
  // The record's reporter is an index into this host's segment.
  const int reporter = hosts_.ranksOn(hosts_.hostOf(rank_))[record.reporter];
  if (reporter != rank_) {
    detail = "the communicator failed on rank " + std::to_string(reporter) + ": " + detail;
  }
  return Error(record.code, op, rank_, detail);
}

int FailureDomain::culprit() const {
  const shm::ShmComm::RecordedFailure record = shm_.recordedFailure();
  return record.complete ? record.culprit : -1;
}

void FailureDomain::markDead(int q) {
  if (!shm_.markDead(local(q))) {
    shm_.wakeAll();
    return;
  }
  // Waking comes with the record (fail() wakes everyone), so sleeping waiters find the
  // reason written rather than blaming q with a wait's own message.
  // Fail the whole communicator, not only waits on q: a rank waiting for a live peer that
  // itself waits for q (in a receive, or behind in an earlier collective) must learn of it
  // too, or it would wait until its timeout.
  fail(ErrorCode::kPeerFailure, q,
       describe(q) +
           " exited without leaving the communicator; restart the job or rebuild the group "
           "without it");
}

bool FailureDomain::spares(std::span<const int> ranks) const {
  if (!failed()) return true;
  const shm::ShmComm::RecordedFailure record = shm_.recordedFailure();
  // A rank on another host lost by a rank that is not this one is known here only as the
  // culprit of the failure that rank recorded (stateOf reads this process's links).
  const bool culpritGone =
      record.code == ErrorCode::kPeerFailure || record.code == ErrorCode::kAborted;
  for (int q : ranks) {
    if (stateOf(q) != RankState::kAlive || (culpritGone && q == record.culprit)) return false;
  }
  return true;
}

Error FailureDomain::sparingError(std::span<const int> ranks, std::string_view op) const {
  // The record keeps the first failure only: a member that died or left after it (a
  // timeout, then a death) is what stops these ranks now, and its name is the answer.
  const int blamed = culprit();
  for (int q : ranks) {
    const RankState state = stateOf(q);
    if (state == RankState::kAlive || q == blamed) continue;
    const Error first = failureError(op);
    return Error(ErrorCode::kPeerFailure, op, rank_,
                 describe(q) + (state == RankState::kDead ? " exited" : " left the communicator") +
                     " after it had failed (" + first.detail() + "); make the group without rank " +
                     std::to_string(q));
  }
  return failureError(op);
}

void FailureDomain::abort() {
  fail(ErrorCode::kAborted, rank_,
       "rank " + std::to_string(rank_) + " aborted communicator '" + name_ + "'");
}

void FailureDomain::peerGone(int q, RankState state, const WaitSpec& spec) {
  std::string message = std::string(spec.op) + " #" + std::to_string(spec.seq) + ": " + describe(q);
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

void FailureDomain::timedOut(uint64_t phase, const WaitSpec& spec) {
  std::vector<int> missing = shm_.laggards(phase);
  const std::vector<int>& here = hosts_.ranksOn(hosts_.hostOf(rank_));
  // Laggards that are inside this very call wait for something themselves (a rank behind
  // them, here or on another host): the rank that waits for that one names it, so listen a
  // while for its reason before naming the laggards. Ranks behind are named at once.
  const bool allInside =
      !missing.empty() && std::all_of(missing.begin(), missing.end(), [&](int m) {
        const shm::ShmComm::Progress p = shm_.progressOf(m);
        return p.started >= spec.seq && p.finished < p.started;
      });
  if (allInside && failureWithin(*this, kTimeoutReasonGrace)) throw failureError(spec.op);
  // Where each laggard is tells behind (finished an earlier collective, never issued this
  // one) from stuck (started one and is waiting inside it).
  std::string where;
  for (size_t i = 0; i < missing.size() && i < 4; ++i) {
    const shm::ShmComm::Progress p = shm_.progressOf(missing[i]);
    where += (i == 0 ? "; " : ", ") + std::string("rank ") + std::to_string(here[missing[i]]) +
             (p.started == 0 ? " has started no collective"
                             : " last started #" + std::to_string(p.started) +
                                   (p.finished < p.started ? " and is still in it"
                                    : p.inCallbacks ? " and finished it, and runs its completion "
                                                      "callbacks"
                                                    : " and finished it"));
  }
  for (int& m : missing) m = here[m];
  std::string message = std::string(spec.op) + " #" + std::to_string(spec.seq) +
                        " hit its timeout of " + std::to_string(spec.timeout.count()) +
                        " ms: rank(s) " + rankList(missing) +
                        " had not arrived (they are behind, stuck in other work, or issued "
                        "a different sequence of collectives)" +
                        where;
  fail(ErrorCode::kTimeout, missing.empty() ? -1 : missing.front(), message);
  throw failureError(spec.op);
}

std::string FailureDomain::progressReport() const {
  std::string out = "  rank  pid      state  last started              last finished\n";
  char line[160];
  for (int q = 0; q < static_cast<int>(roster_.peers.size()); ++q) {
    if (!onThisHost(q)) {
      std::snprintf(line, sizeof line, "  %4d  on host '%s' (its progress is not visible here)\n",
                    q, roster_.peers[q].hostname.c_str());
      out += line;
      continue;
    }
    const shm::ShmComm::Progress p = shm_.progressOf(local(q));
    const std::string started =
        p.started == 0 ? std::string("-")
                       : std::string(collectiveName(static_cast<CollectiveKind>(p.kind))) + " #" +
                             std::to_string(p.started);
    const std::string finished = p.finished == 0 ? "-" : "#" + std::to_string(p.finished);
    const bool inside = p.started != 0 && p.finished < p.started;
    std::snprintf(line, sizeof line, "  %4d  %-7d  %-5s  %-24s  %-13s%s%s\n", q,
                  shm_.pidOf(local(q)), rankStateName(stateOf(q)), started.c_str(),
                  finished.c_str(),
                  inside          ? "  (inside it)"
                  : p.inCallbacks ? "  (in its completion callbacks)"
                                  : "",
                  q == rank_ ? "  <- this rank" : "");
    out += line;
  }
  return out;
}

void FailureDomain::report(const std::exception_ptr& failure) {
  // Only failures an operator must diagnose; an abort or a bad argument explains itself.
  const std::optional<ErrorCode> code = codeOf(failure);
  if (!code || (*code != ErrorCode::kTimeout && *code != ErrorCode::kPeerFailure &&
                *code != ErrorCode::kMismatch)) {
    return;
  }
  if (reported_.exchange(true)) return;
  const std::vector<FlightRecord> records = flightRecord();
  std::string report = "loom: communicator '" + name_ + "' failed on rank " +
                       std::to_string(rank_) + " of " + std::to_string(roster_.peers.size()) +
                       " (pid " + std::to_string(::getpid()) + "): " + failureMessage(failure) +
                       "\n";
  if (!rankLegend_.empty()) report += "loom: the ranks in this report are " + rankLegend_ + "\n";
  report += "loom: what each rank of '" + name_ + "' was doing:\n" + progressReport();
  const std::optional<std::string> dumpPrefix = env::text("LOOM_FLIGHT_RECORDER_DUMP");
  std::optional<std::string> unwritten;  // why the record did not go to its file
  if (dumpPrefix) {
    // The whole record goes to a file per communicator and rank; stderr gets a pointer.
    const std::string path = *dumpPrefix + name_ + ".rank" + std::to_string(rank_) + ".txt";
    unwritten = appendToFile(
        path, report + "loom: this process's flight record (" + std::to_string(records.size()) +
                  " operations, oldest first):\n" + formatFlightRecord(records));
    if (unwritten) {
      report += "loom: could not write the flight record to " + path + " (" + *unwritten +
                "); its last operations follow instead\n";
    } else {
      report += "loom: flight record written to " + path + "\n";
    }
  }
  if (!dumpPrefix || unwritten) {
    const size_t shown = std::min(records.size(), kReportedEntries);
    const std::vector<FlightRecord> recent(records.end() - static_cast<std::ptrdiff_t>(shown),
                                           records.end());
    report += "loom: this process's last " + std::to_string(shown) + " operations";
    if (!dumpPrefix) report += " (set LOOM_FLIGHT_RECORDER_DUMP=<path prefix> to write all)";
    report += ":\n" + formatFlightRecord(recent);
  }
  std::fputs(report.c_str(), stderr);
  std::fflush(stderr);
}

}  // namespace loom::detail
