#pragma once

// One communicator's failure domain: the single place that decides what a failure says and
// who learns of it. Every failure (a dead rank, a timeout, a mismatch, an abort) is recorded
// once in the host's shared failure record, which every wait on this host watches, so one
// rank's discovery releases all of them at once; the messages name the operation, the ranks
// involved and where each of them was. It also keeps the progress report (what every rank
// last started and finished) and prints the failure report, once per communicator.

#include <atomic>
#include <exception>
#include <string>
#include <string_view>

#include "transport/failures.h"
#include "transport/shm/shm_comm.h"

namespace loom::detail {

class FailureDomain final : public Failures {
 public:
  /// The domain of the communicator `name`, seen from `shm`'s rank.
  FailureDomain(shm::ShmComm& shm, std::string name);

  void fail(ErrorCode code, int culprit, std::string_view message) override;
  bool failed() const override { return shm_.failed(); }
  Error failureError(std::string_view op) const override;
  RankState stateOf(int q) const override { return shm_.stateOf(q); }
  [[noreturn]] void peerGone(int q, RankState state, const WaitSpec& spec) override;
  [[noreturn]] void timedOut(uint64_t phase, const WaitSpec& spec) override;

  /// Rank q's process exited without leaving the communicator: fails it for everyone (no
  /// effect if q left normally). Safe from any thread.
  void markDead(int q);
  /// This rank aborts the communicator.
  void abort();

  /// A table of what every rank last started and finished, with its pid and liveness.
  std::string progressReport() const;
  /// Prints the failure report on stderr (or to LOOM_FLIGHT_RECORDER_DUMP files) for a
  /// failure an operator must diagnose (timeout, dead peer, mismatch), once per domain.
  void report(const std::exception_ptr& failure);

 private:
  shm::ShmComm& shm_;
  const std::string name_;
  const int rank_;
  std::atomic<bool> reported_{false};
};

}  // namespace loom::detail
