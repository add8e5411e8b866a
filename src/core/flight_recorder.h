#pragma once

// The process-wide ring behind loom::flightRecord(). Each operation is recorded when it is
// issued, marked when it starts and when it ends; the newest entries overwrite the oldest.
// Issuing takes a short critical section; marking an operation started or ended (every
// collective does both) takes none: one compare-and-swap on the entry's tag, so a blocking
// call pays one lock where it paid three. A mark for an entry overwritten while its operation
// ran (1024 newer ones issued meanwhile) changes nothing but, at worst, one of its times.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string_view>
#include <vector>

#include "loom/flight_recorder.h"

namespace loom::detail {

class FlightRecorder {
 public:
  /// The process's recorder, sized from LOOM_FLIGHT_RECORDER on first use.
  static FlightRecorder& instance();

  explicit FlightRecorder(size_t capacity);

  /// What an entry is about; `arguments` is formatted only when someone reads the record.
  struct Subject {
    std::string_view communicator;
    int rank = -1;
    int size = 0;
    uint64_t sequence = 0;
    std::string_view operation;  ///< must outlive the recorder (a literal)
    uint64_t count = 0;          ///< elements, or bytes for send/recv
    int8_t type = -1;            ///< DataType, or -1
    int8_t reduce = -1;          ///< ReduceKind, or -1
    int peer = -1;               ///< root or peer, or -1
    int tag = 0;                 ///< send/recv tag
    bool pointToPoint = false;   ///< send/recv: count is bytes, peer and tag apply
  };

  /// Records an issued operation; returns its id (0 when recording is off).
  uint64_t issued(const Subject& subject) { return issued(subject, Clock::now()); }
  /// ... issued at `at` (a time the caller has read anyway: one clock read fewer per call).
  uint64_t issued(const Subject& subject, std::chrono::steady_clock::time_point at);
  /// Marks operation `id` running.
  void started(uint64_t id) { started(id, Clock::now()); }
  /// ... since `at`.
  void started(uint64_t id, std::chrono::steady_clock::time_point at);
  /// Sets operation `id`'s element count, where it is known only once the operation runs
  /// (a placed all_gather_v learns its outputs then).
  void counted(uint64_t id, uint64_t count);
  /// Marks operation `id` ended, with its failure message if `error` is not empty.
  void ended(uint64_t id, std::string_view error);

  /// The live entries, oldest first.
  std::vector<FlightRecord> snapshot() const;

 private:
  using Clock = std::chrono::steady_clock;
  using Ticks = Clock::rep;
  struct Entry {
    // The operation's id and its state, as one word (tagOf), so a mark checks that the entry
    // is still its operation's and changes the state at once.
    std::atomic<uint64_t> tag{0};
    // torch's hashed group names are 40 characters; longer names and errors end in "...".
    char communicator[64] = {};
    Subject subject;  // string_views into `communicator` and a literal; written under mutex_
    std::atomic<Ticks> issuedAt{0}, startedAt{0}, endedAt{0};
    char error[384] = {};  // written under mutex_
  };
  static uint64_t tagOf(uint64_t id, FlightRecord::State state) {
    return id << 8 | static_cast<uint64_t>(state);
  }
  static uint64_t idOf(uint64_t tag) { return tag >> 8; }
  static FlightRecord::State stateOf(uint64_t tag) {
    return static_cast<FlightRecord::State>(tag & 0xff);
  }
  /// Moves entry `id` from state `from` to `to` if it is still that operation's and in that
  /// state; true if it did.
  bool advance(Entry& e, uint64_t id, FlightRecord::State from, FlightRecord::State to);

  // Wall-clock times are derived from the steady ones at read time: one clock read fewer
  // per operation.
  const std::chrono::system_clock::time_point wallAtStart_;
  const Clock::time_point steadyAtStart_;
  mutable std::mutex mutex_;
  std::vector<Entry> ring_;
  uint64_t next_ = 1;
};

}  // namespace loom::detail
