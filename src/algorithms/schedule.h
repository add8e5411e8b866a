#pragma once

// The schedules of collectives across hosts, without running them: a context that writes
// down each rank's steps instead of moving bytes, a checker that plays every rank's steps
// against each other, and a cost model that times them.
//
// The checker treats every send as a rendezvous (it completes only when the receiver is in
// the step that takes it, and a step ends when all of its transfers have): a schedule that
// finishes under that rule finishes with any amount of buffering. It also checks that each
// pair agrees on every message's tag and size, in order, and that all ranks of a host issue
// the same local collectives. tests/unit/schedule_test.cc runs it on many layouts, and
// `loom-schedule` (bench/) up to thousands of ranks for docs/SCALING.md.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "algorithms/across_hosts.h"

namespace loom {

/// One message of a recorded exchange.
struct ScheduledMessage {
  int peer = 0;
  size_t bytes = 0;
  int tag = 0;
};

/// One step of a rank's schedule: a collective among its host's ranks, or a network
/// exchange; with the memory work (copies and reductions) done since the previous step on
/// the same thread. Steps of rail jobs run on the rank's rail thread (onRail), between a
/// start marker (the job is handed over) and a finish marker (the collective's thread
/// waits for it), so the cost model overlaps them with the collective's later local steps.
struct ScheduleStep {
  enum class Marker : uint8_t { kNone, kRailStart, kRailDone, kRailFinish };
  Marker marker = Marker::kNone;
  size_t job = 0;  ///< a marker's rail job
  bool onRail = false;
  bool local = false;
  // A local step: the collective and a digest of everything its ranks must agree on.
  CollectiveKind collective = CollectiveKind::kBarrier;
  uint64_t digest = 0;
  size_t localBytes = 0;  ///< the largest of this rank's input and output bytes
  // An exchange.
  std::vector<ScheduledMessage> sends, receives;
  size_t memoryBytes = 0;  ///< bytes copied and reduced (read + written) before this step
};

using Schedule = std::vector<ScheduleStep>;

/// An AcrossHostsContext that records instead of running. Buffers are never touched: the
/// caller's and the scratch addresses are only compared and offset.
class RecordingContext final : public AcrossHostsContext {
 public:
  RecordingContext(const HostLayout& layout, ScratchArena& arena);
  void runLocal(const CollectiveArgs& args) override;
  void exchange(std::span<const NetTransfer> sends, std::span<const NetTransfer> receives) override;
  void reduce(void* dst, std::span<const void* const> srcs, size_t count,
              const kernels::ReduceSpec& spec) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void zero(void* dst, size_t bytes) override;
  void convert(void* dst, DataType to, const void* src, DataType from, size_t count) override;
  uint8_t* scratch(size_t bytes) override;
  /// Records the job's steps at once, marked as the rail thread's (one lane: the cost model
  /// has one rail thread per rank).
  size_t startRail(RailSteps steps, int lane) override;
  void finishRail(size_t ticket) override;

  /// The steps so far (the memory work after the last step becomes a step of its own).
  Schedule take();

 private:
  ScheduleStep& push(ScheduleStep step);
  size_t& memory() { return onRail_ ? railMemory_ : memory_; }

  Schedule steps_;
  size_t memory_ = 0;      // since the collective's thread's last step
  size_t railMemory_ = 0;  // since the rail thread's last step
  bool onRail_ = false;
  size_t jobs_ = 0;
  uintptr_t nextScratch_;
};

/// What a collective to be simulated is: its kind and arguments, the same on every rank.
struct SimulatedOp {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  DataType type = DataType::kFloat32;
  ReduceOp op;
  int root = 0;
  /// Elements: the buffer (all_reduce, reduce, broadcast) or per rank (the others).
  size_t count = 0;
  /// Per-rank counts for the V forms of all_gather and reduce_scatter (empty: all `count`).
  std::vector<size_t> counts;
};

/// Records the schedule of `op` on every rank of a communicator whose ranks are placed on
/// hosts as `ranksOn` says (each host's ranks ascending; together 0..P-1).
std::vector<Schedule> recordSchedules(const std::vector<std::vector<int>>& ranksOn,
                                      const SimulatedOp& op);

/// Costs of the simulation. An exchange step costs netLatency plus its larger direction's
/// bytes over the rank's share of its host's network bandwidth (the host's ranks that use
/// the network share it). A local collective costs localLatency plus the larger of a rank's
/// input and output bytes over localGBps (a shared-memory collective's rate on that host,
/// as loom-bench measures it). Copies and reductions outside them run at memGBps.
struct CostModel {
  double netLatencyUs = 10;
  double hostNetGBps = 25;  ///< per host and direction (200 Gb/s)
  double localLatencyUs = 2;
  double localGBps = 8;  ///< bytes of a local collective per second
  double memGBps = 20;   ///< copy bandwidth per rank, read + write
};

/// What the checker found.
struct ScheduleReport {
  std::string error;            ///< empty if every rank finished and everything matched
  size_t maxSteps = 0;          ///< the most steps (local and network) any rank took
  size_t maxNetworkSteps = 0;   ///< the most exchanges any rank took
  size_t maxSentBytes = 0;      ///< the most bytes any rank sent over the network
  size_t maxHostSentBytes = 0;  ///< the most bytes any host sent over the network
  size_t messages = 0;          ///< messages in all
  double timeUs = 0;            ///< the simulated time of the slowest rank
};

/// Plays the schedules of the ranks placed as `ranksOn` says against each other.
ScheduleReport checkSchedules(const std::vector<std::vector<int>>& ranksOn,
                              const std::vector<Schedule>& schedules, const CostModel& cost = {});

}  // namespace loom
