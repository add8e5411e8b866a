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
  const size_t n = std::min(text.size(), N - 1);
  std::memcpy(dst, text.data(), n);
  dst[n] = '\0';
}

double millisBetween(std::chrono::steady_clock::time_point a,
                     std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
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

uint64_t FlightRecorder::issued(const Subject& subject) {
  if (ring_.empty()) return 0;
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t id = next_++;
  Entry& e = ring_[id % ring_.size()];
  e.id = id;
  copyTruncated(e.communicator, subject.communicator);
  e.subject = subject;
  e.subject.communicator = {};
  e.state = FlightRecord::State::kQueued;
  e.issuedAt = e.startedAt = e.endedAt = now;
  e.error[0] = '\0';
  return id;
}

FlightRecorder::Entry* FlightRecorder::find(uint64_t id) {
  if (id == 0) return nullptr;
  Entry& e = ring_[id % ring_.size()];
  return e.id == id ? &e : nullptr;
}

void FlightRecorder::started(uint64_t id) {
  if (id == 0) return;
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  if (Entry* e = find(id)) {
    e->state = FlightRecord::State::kRunning;
    e->startedAt = now;
  }
}

void FlightRecorder::ended(uint64_t id, std::string_view error) {
  if (id == 0) return;
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  if (Entry* e = find(id)) {
    // Send/recv are never marked started: they run from the moment they are issued.
    if (e->state == FlightRecord::State::kQueued) e->startedAt = e->issuedAt;
    e->state = error.empty() ? FlightRecord::State::kCompleted : FlightRecord::State::kFailed;
    e->endedAt = now;
    copyTruncated(e->error, error);
  }
}

std::vector<FlightRecord> FlightRecorder::snapshot() const {
  const auto now = Clock::now();
  std::vector<FlightRecord> out;
  std::lock_guard<std::mutex> lock(mutex_);
  out.reserve(ring_.size());
  const uint64_t first = next_ > ring_.size() ? next_ - ring_.size() : 1;
  for (uint64_t id = first; id < next_; ++id) {
    const Entry& e = ring_[id % ring_.size()];
    if (e.id != id) continue;
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
    r.state = e.state;
    r.issued = wallAtStart_ + std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                  e.issuedAt - steadyAtStart_);
    const bool running = e.state == FlightRecord::State::kRunning;
    const bool queued = e.state == FlightRecord::State::kQueued;
    r.queuedMs = millisBetween(e.issuedAt, queued ? now : e.startedAt);
    r.ranMs = queued ? 0 : millisBetween(e.startedAt, running ? now : e.endedAt);
    r.error = e.error;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace detail
}  // namespace loom
