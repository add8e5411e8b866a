#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace loom {

/// One operation in this process's flight record: what was issued, on which communicator,
/// and how far it got. The record is a ring of the most recent operations of every
/// communicator in the process (LOOM_FLIGHT_RECORDER entries, default 1024; 0 turns it off).
struct FlightRecord {
  enum class State { kQueued, kRunning, kCompleted, kFailed };

  uint64_t id = 0;           ///< order of issue within this process, from 1
  std::string communicator;  ///< the communicator's name ("world", "tp", ...; "..." after 60)
  int rank = -1;             ///< this process's rank in it
  int size = 0;              ///< its size
  uint64_t sequence = 0;     ///< the operation's sequence number there (0 for send/recv)
  std::string operation;     ///< "all_reduce", "send", ...
  std::string arguments;     ///< "count 1024, float32, SUM", "peer 3, tag 0, 4096 bytes"
  State state = State::kQueued;
  std::chrono::system_clock::time_point issued;  ///< wall clock, to line up logs of ranks
  /// From issue until it started (or until now, if still queued); a send or receive runs
  /// from its issue.
  double queuedMs = 0;
  double ranMs = 0;   ///< from start until it ended (or until now, if still running)
  std::string error;  ///< the failure's message, for kFailed ("..." after 380 characters)
};

/// Name of a record state ("queued", "running", "completed", "failed").
const char* flightStateName(FlightRecord::State state);

/// The operations in this process's flight record, oldest first.
std::vector<FlightRecord> flightRecord();

/// The records as a table, one line each, for logs and dumps.
std::string formatFlightRecord(const std::vector<FlightRecord>& records);

}  // namespace loom
