#pragma once

// One communicator's failure domain: the single place that decides what a failure says and
// who learns of it. Every failure (a dead rank, a timeout, a mismatch, an abort) is recorded
// once in the host's shared failure record, which every wait on this host watches, so one
// rank's discovery releases all of them at once; the messages name the operation, the ranks
// involved and where each of them was. It also keeps the progress report (what every rank
// last started and finished) and prints the failure report, once per communicator.
//
// It speaks communicator ranks. The shared segment holds this host's ranks only (at their
// local index); ranks on other hosts are known from the roster and the network.

#include <atomic>
#include <exception>
#include <memory>
#include <string>
#include <string_view>

#include "core/bootstrap.h"
#include "core/topology.h"
#include "transport/failures.h"
#include "transport/shm/shm_comm.h"

namespace loom::detail {

class FailureDomain final : public Failures {
 public:
  /// The domain of the communicator `name` (whose ranks `roster` lists, placed by `hosts`),
  /// seen from rank `rank`, whose host's segment is `shm`. Keeps references to all three.
  /// `rankLegend` is CommOptions::rankLegend, for the failure report.
  FailureDomain(shm::ShmComm& shm, std::string name, std::string rankLegend, int rank,
                const Roster& roster, const HostMap& hosts);

  void fail(ErrorCode code, int culprit, std::string_view message) override;
  bool failed() const override { return shm_.failed(); }
  Error failureError(std::string_view op) const override;
  int culprit() const override;
  RankState stateOf(int q) const override;
  bool spares(std::span<const int> ranks) const override;
  Error sparingError(std::span<const int> ranks, std::string_view op) const override;
  [[noreturn]] void peerGone(int q, RankState state, const WaitSpec& spec) override;
  [[noreturn]] void timedOut(uint64_t phase, const WaitSpec& spec) override;
  void peerLost(int q, std::string_view why) override;
  void peerLeft(int q) override;
  void noteGoodbye(int q) override;
  bool saidGoodbye(int q) const override;

  /// Rank q (of this host) exited without leaving the communicator: fails it for everyone
  /// (no effect if q left normally). Safe from any thread.
  void markDead(int q);
  /// This rank aborts the communicator.
  void abort();

  /// A table of what every rank last started and finished, with its pid and liveness.
  std::string progressReport() const;
  /// Prints the failure report on stderr (or to LOOM_FLIGHT_RECORDER_DUMP files) for a
  /// failure an operator must diagnose (timeout, dead peer, mismatch), once per domain.
  void report(const std::exception_ptr& failure);

 private:
  /// Rank q's index in this host's segment (q must be on this host).
  int local(int q) const { return hosts_.localIndex(q); }
  bool onThisHost(int q) const { return hosts_.hostOf(q) == hosts_.hostOf(rank_); }
  /// "rank 2 (pid 4242)" on this host, "rank 5 (host 'b', 10.0.0.2:41234)" elsewhere.
  std::string describe(int q) const;

  shm::ShmComm& shm_;
  const std::string name_;
  const std::string rankLegend_;
  const int rank_;
  const Roster& roster_;
  const HostMap& hosts_;
  // RankState of ranks on other hosts, as this rank's own links found them (a channel's
  // goodbye comes after everything sent on it: another rank's says nothing of this one's).
  std::unique_ptr<std::atomic<uint8_t>[]> remote_;
  std::atomic<bool> reported_{false};
};

}  // namespace loom::detail
