// The flight record: a ring of recent operations, and its table format.

#include "core/flight_recorder.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "loom/types.h"
#include "util/env.h"

namespace loom {

namespace {

// Copies `text` into a fixed buffer, truncating; always NUL-terminated.
template <size_t N>
void copyTruncated(char (&dst)[N], std::string_view text) {
  static_assert(N > 4);
  const bool cut = text.size() > N - 1;
  const size_t n = cut ? N - 4 : text.size();
  std::memcpy(dst, text.data(), n);
  if (cut) std::memcpy(dst + n, "...", 3);  // says the text goes on
  dst[cut ? N - 1 : n] = '\0';
}

}  // namespace

const char* flightStateName(FlightRecord::State state) {
  switch (state) {
    case FlightRecord::State::kQueued: return "queued";
    case FlightRecord::State::kRunning: return "running";
    case FlightRecord::State::kCompleted: return "completed";
    case FlightRecord::State::kFailed: return "failed";
  }
  return "?";
}

std::vector<FlightRecord> flightRecord() {
  return detail::FlightRecorder::instance().snapshot();
}

std::string formatFlightRecord(const std::vector<FlightRecord>& records) {
  std::string out;
  char line[512];
  std::snprintf(line, sizeof line, "%8s  %-24s %-9s %6s  %-15s %-36s %-9s %12s %10s %10s\n", "id",
                "issued (local time)", "comm", "rank", "operation", "arguments", "state",
                "sequence", "queued ms", "ran ms");
  out += line;
  for (const FlightRecord& r : records) {
    const std::time_t seconds = std::chrono::system_clock::to_time_t(r.issued);
    const auto micros =
        std::chrono::duration_cast<std::chrono::microseconds>(r.issued.time_since_epoch()) %
        std::chrono::seconds(1);
    std::tm local{};
    ::localtime_r(&seconds, &local);
    char when[40];
    std::strftime(when, sizeof when, "%H:%M:%S", &local);
    char issued[48];
    std::snprintf(issued, sizeof issued, "%s.%06lld", when, static_cast<long long>(micros.count()));
    const std::string rank = std::to_string(r.rank) + "/" + std::to_string(r.size);
    std::snprintf(line, sizeof line, "%8llu  %-24s %-9s %6s  %-15s %-36s %-9s %12llu %10.3f %10.3f",
                  static_cast<unsigned long long>(r.id), issued, r.communicator.c_str(),
                  rank.c_str(), r.operation.c_str(), r.arguments.c_str(), flightStateName(r.state),
                  static_cast<unsigned long long>(r.sequence), r.queuedMs, r.ranMs);
    out += line;
    if (!r.error.empty()) out += "  " + r.error;
    out += "\n";
  }
  return out;
}

namespace detail {

FlightRecorder& FlightRecorder::instance() {
  // Never destroyed: operations may still complete on loom threads while the process exits.
  static auto* recorder = new FlightRecorder(
      static_cast<size_t>(env::integer("LOOM_FLIGHT_RECORDER", 1024, 0, 1 << 20)));
  return *recorder;
}

FlightRecorder::FlightRecorder(size_t capacity)
    : wallAtStart_(std::chrono::system_clock::now()),
      steadyAtStart_(Clock::now()),
      ring_(capacity) {}

uint64_t FlightRecorder::issued(const Subject& subject, Clock::time_point at) {
  if (ring_.empty()) return 0;
  const Ticks now = at.time_since_epoch().count();
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t id = next_++;
  Entry& e = ring_[id % ring_.size()];
  // The tag goes first: a late mark of the operation this entry held no longer matches. A
  // send or receive runs from the moment it is issued (its wait for the peer is its run).
  e.tag.store(tagOf(id, subject.pointToPoint ? FlightRecord::State::kRunning
                                             : FlightRecord::State::kQueued),
              std::memory_order_relaxed);
  copyTruncated(e.communicator, subject.communicator);
  e.subject = subject;
  e.subject.communicator = {};
  e.issuedAt.store(now, std::memory_order_relaxed);
  e.startedAt.store(now, std::memory_order_relaxed);
  e.endedAt.store(now, std::memory_order_relaxed);
  e.error[0] = '\0';
  return id;
}

bool FlightRecorder::advance(Entry& e, uint64_t id, FlightRecord::State from,
                             FlightRecord::State to) {
  uint64_t expected = tagOf(id, from);
  return e.tag.compare_exchange_strong(expected, tagOf(id, to), std::memory_order_relaxed);
}

void FlightRecorder::started(uint64_t id, Clock::time_point at) {
  if (id == 0) return;
  const Ticks now = at.time_since_epoch().count();
  Entry& e = ring_[id % ring_.size()];
  if (advance(e, id, FlightRecord::State::kQueued, FlightRecord::State::kRunning)) {
    e.startedAt.store(now, std::memory_order_relaxed);
  }
}

void FlightRecorder::counted(uint64_t id, uint64_t count) {
  if (id == 0) return;
  Entry& e = ring_[id % ring_.size()];
  std::lock_guard<std::mutex> lock(mutex_);  // the subject is read and written under it
  if (idOf(e.tag.load(std::memory_order_relaxed)) == id) e.subject.count = count;
}

void FlightRecorder::ended(uint64_t id, std::string_view error) {
  if (id == 0) return;
  const Ticks now = Clock::now().time_since_epoch().count();
  Entry& e = ring_[id % ring_.size()];
  const auto to = error.empty() ? FlightRecord::State::kCompleted : FlightRecord::State::kFailed;
  // The error text is read under the mutex, so a failure writes it under the mutex too.
  std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
  if (!error.empty()) lock.lock();
  // From running, or from queued (a call refused before it ran), whichever it is when the
  // swap lands.
  uint64_t tag = e.tag.load(std::memory_order_relaxed);
  do {
    if (idOf(tag) != id) return;  // overwritten by a newer operation
    if (stateOf(tag) != FlightRecord::State::kQueued &&
        stateOf(tag) != FlightRecord::State::kRunning) {
      return;
    }
  } while (!e.tag.compare_exchange_weak(tag, tagOf(id, to), std::memory_order_relaxed));
  if (stateOf(tag) == FlightRecord::State::kQueued) {
    e.startedAt.store(e.issuedAt.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
  e.endedAt.store(now, std::memory_order_relaxed);
  if (!error.empty()) copyTruncated(e.error, error);
}

std::vector<FlightRecord> FlightRecorder::snapshot() const {
  const Ticks now = Clock::now().time_since_epoch().count();
  auto millis = [](Ticks from, Ticks to) {
    return std::chrono::duration<double, std::milli>(Clock::duration(to - from)).count();
  };
  std::vector<FlightRecord> out;
  std::lock_guard<std::mutex> lock(mutex_);
  out.reserve(ring_.size());
  const uint64_t first = next_ > ring_.size() ? next_ - ring_.size() : 1;
  for (uint64_t id = first; id < next_; ++id) {
    const Entry& e = ring_[id % ring_.size()];
    const uint64_t tag = e.tag.load(std::memory_order_relaxed);
    if (idOf(tag) != id) continue;
    FlightRecord r;
    r.id = id;
    r.communicator = e.communicator;
    r.rank = e.subject.rank;
    r.size = e.subject.size;
    r.sequence = e.subject.sequence;
    r.operation = std::string(e.subject.operation);
    const Subject& s = e.subject;
    if (s.pointToPoint) {
      r.arguments = (s.peer < 0 ? std::string("any peer") : "peer " + std::to_string(s.peer)) +
                    ", tag " + std::to_string(s.tag) + ", " + std::to_string(s.count) + " bytes";
    } else if (s.type >= 0) {
      r.arguments = "count " + std::to_string(s.count) + ", " +
                    std::string(dataTypeName(static_cast<DataType>(s.type)));
      if (s.reduce >= 0) {
        r.arguments += ", " + std::string(reduceKindName(static_cast<ReduceKind>(s.reduce)));
      }
      if (s.peer >= 0) r.arguments += ", root " + std::to_string(s.peer);
    }
    r.state = stateOf(tag);
    // A mark lands its time just after its state, so a state read a moment before its time
    // may come with the time before (the issue time). (A mark that lost the race with a
    // newer operation taking over its entry, 1024 operations later, can leave its time
    // there: a debugging record's imprecision, never a crash.)
    const Ticks issuedAt = e.issuedAt.load(std::memory_order_relaxed);
    const Ticks startedAt = e.startedAt.load(std::memory_order_relaxed);
    const Ticks endedAt = e.endedAt.load(std::memory_order_relaxed);
    r.issued = wallAtStart_ + std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                  Clock::time_point(Clock::duration(issuedAt)) - steadyAtStart_);
    const bool running = r.state == FlightRecord::State::kRunning;
    const bool queued = r.state == FlightRecord::State::kQueued;
    r.queuedMs = millis(issuedAt, queued ? now : startedAt);
    r.ranMs = queued ? 0 : millis(startedAt, running ? now : endedAt);
    r.error = r.state == FlightRecord::State::kFailed ? e.error : "";
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace detail
}  // namespace loom
