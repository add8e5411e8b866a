// Recording, checking and timing the schedules of collectives across hosts.

#include "algorithms/schedule.h"

#include <algorithm>
#include <deque>
#include <numeric>
#include <unordered_map>

namespace loom {

namespace {

// Fake addresses for the recorder: never dereferenced, only offset and compared.
constexpr uintptr_t kFakeInput = uintptr_t{1} << 40;
constexpr uintptr_t kFakeOutput = uintptr_t{2} << 40;
constexpr uintptr_t kFakeScratch = uintptr_t{3} << 40;

uint64_t mix(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= static_cast<uint8_t>(v >> (8 * i));
    h *= 0x100000001b3ULL;
  }
  return h;
}

size_t sum(const std::vector<size_t>& v) {
  return std::accumulate(v.begin(), v.end(), size_t{0});
}

}  // namespace

RecordingContext::RecordingContext(const HostLayout& layout, ScratchArena& arena)
    : AcrossHostsContext(layout, arena), nextScratch_(kFakeScratch) {}

ScheduleStep& RecordingContext::push(ScheduleStep step) {
  step.onRail = onRail_;
  step.memoryBytes = memory();
  memory() = 0;
  steps_.push_back(std::move(step));
  return steps_.back();
}

size_t RecordingContext::startRail(RailSteps steps, int /*lane*/) {
  const size_t job = jobs_++;
  ScheduleStep start;
  start.marker = ScheduleStep::Marker::kRailStart;
  start.job = job;
  push(std::move(start));
  onRail_ = true;
  std::exception_ptr failure;
  try {
    steps(*this);
  } catch (...) {
    failure = std::current_exception();
  }
  ScheduleStep done;
  done.marker = ScheduleStep::Marker::kRailDone;
  done.job = job;
  push(std::move(done));
  onRail_ = false;
  if (failure) std::rethrow_exception(failure);
  return job;
}

void RecordingContext::finishRail(size_t ticket) {
  ScheduleStep finish;
  finish.marker = ScheduleStep::Marker::kRailFinish;
  finish.job = ticket;
  push(std::move(finish));
}

void RecordingContext::runLocal(const CollectiveArgs& args) {
  ScheduleStep step;
  step.local = true;
  step.collective = args.kind;
  uint64_t h = 0xcbf29ce484222325ULL;
  h = mix(h, static_cast<uint64_t>(args.kind) | uint64_t{static_cast<uint8_t>(args.type)} << 8 |
                 uint64_t{static_cast<uint8_t>(args.op.kind())} << 16);
  h = mix(h, static_cast<uint64_t>(args.root));
  h = mix(h, args.count);
  h = mix(h, args.countsHash);
  h = mix(h, args.variable ? 1 : 0);  // the V form has a phase the equal one has not
  const size_t es = elementSize(args.type);
  switch (args.kind) {
    case CollectiveKind::kAllGather:
      for (size_t n : args.outputCounts) h = mix(h, n);
      step.localBytes = sum(args.outputCounts) * es;
      break;
    case CollectiveKind::kReduceScatter:
      for (size_t n : args.inputCounts) h = mix(h, n);
      step.localBytes = sum(args.inputCounts) * es;
      break;
    case CollectiveKind::kAllToAll:
      // Pairwise counts: the checker compares each rank's sends with the others' receives.
      for (size_t n : args.inputCounts) step.sends.push_back({0, n * es, 0});
      for (size_t n : args.outputCounts) step.receives.push_back({0, n * es, 0});
      step.localBytes = std::max(sum(args.inputCounts), sum(args.outputCounts)) * es;
      break;
    default: step.localBytes = args.count * es;
  }
  step.digest = h;
  push(std::move(step));
}

void RecordingContext::exchange(std::span<const NetTransfer> sends,
                                std::span<const NetTransfer> receives) {
  ScheduleStep step;
  for (const NetTransfer& t : sends) step.sends.push_back({t.peer, t.bytes, t.tag});
  for (const NetTransfer& t : receives) step.receives.push_back({t.peer, t.bytes, t.tag});
  push(std::move(step));
}

void RecordingContext::reduce(void*, std::span<const void* const> srcs, size_t count,
                              const kernels::ReduceSpec& spec) {
  memory() += count * elementSize(spec.type) * (srcs.size() + 1);
}

void RecordingContext::copy(void* dst, const void* src, size_t bytes) {
  if (dst != src) memory() += 2 * bytes;
}

void RecordingContext::zero(void*, size_t bytes) {
  memory() += bytes;
}

void RecordingContext::convert(void*, DataType to, const void*, DataType from, size_t count) {
  memory() += count * (elementSize(to) + elementSize(from));
}

uint8_t* RecordingContext::scratch(size_t bytes) {
  const uintptr_t address = nextScratch_;
  nextScratch_ += (bytes + 127) / 64 * 64;
  return reinterpret_cast<uint8_t*>(address);
}

Schedule RecordingContext::take() {
  if (memory_ != 0) push(ScheduleStep{});  // the memory work after the last step
  return std::move(steps_);
}

namespace {

// The arguments of `op` on any rank of `size`, at fake addresses.
CollectiveArgs simulatedArgs(const SimulatedOp& op, int size) {
  auto* in = reinterpret_cast<uint8_t*>(kFakeInput);
  auto* out = reinterpret_cast<uint8_t*>(kFakeOutput);
  const size_t es = elementSize(op.type);
  std::vector<size_t> counts = op.counts;
  if (counts.empty()) counts.assign(static_cast<size_t>(size), op.count);
  CollectiveArgs a = CollectiveArgs::of(op.kind, op.type, op.op, op.root, op.count, in, out);
  std::vector<size_t> offsets{0};  // of each rank's block
  for (size_t n : counts) offsets.push_back(offsets.back() + n);
  switch (op.kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kGather:
      for (int q = 0; q < size; ++q) a.outputs.push_back(out + offsets[q] * es);
      a.outputCounts = counts;
      a.count = op.kind == CollectiveKind::kGather ? op.count : sum(counts);
      break;
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kScatter:
      for (int q = 0; q < size; ++q) a.inputs.push_back(in + offsets[q] * es);
      a.inputCounts = counts;
      a.count = op.kind == CollectiveKind::kScatter ? op.count : sum(counts);
      break;
    case CollectiveKind::kAllToAll:
      for (int q = 0; q < size; ++q) {
        a.inputs.push_back(in + q * op.count * es);
        a.outputs.push_back(out + q * op.count * es);
      }
      a.inputCounts = counts;
      a.outputCounts = counts;
      break;
    default: break;
  }
  a.variable = !op.counts.empty();
  return a;
}

}  // namespace

std::vector<Schedule> recordSchedules(const std::vector<std::vector<int>>& ranksOn,
                                      const SimulatedOp& op) {
  // One layout, re-aimed at each rank in turn (copying the placement of thousands of ranks
  // for each of them would cost more than recording).
  HostLayout layout = HostLayout::of(ranksOn, 0);
  std::vector<Schedule> schedules(static_cast<size_t>(layout.size));
  ScratchArena unused;
  for (int h = 0; h < layout.hosts(); ++h) {
    for (int i = 0; i < static_cast<int>(ranksOn[h].size()); ++i) {
      layout.rank = ranksOn[h][i];
      layout.host = h;
      layout.localIndex = i;
      RecordingContext ctx(layout, unused);
      runAcrossHosts(ctx, simulatedArgs(op, layout.size));
      schedules[layout.rank] = ctx.take();
    }
  }
  return schedules;
}

namespace {

// The rendezvous simulation behind checkSchedules.
class Checker {
 public:
  Checker(const std::vector<std::vector<int>>& ranksOn, const std::vector<Schedule>& schedules,
          const CostModel& cost)
      : ranksOn_(ranksOn), s_(schedules), cost_(cost), size_(schedules.size()) {
    hostOf_.resize(size_);
    for (int h = 0; h < static_cast<int>(ranksOn.size()); ++h) {
      for (int q : ranksOn[h]) hostOf_[q] = h;
    }
    pos_.assign(size_, 0);
    clock_.assign(size_, 0);
    railClock_.assign(size_, 0);
    railDone_.resize(size_);
    remaining_.assign(size_, 0);
    latest_.assign(size_, 0);
    sent_.assign(size_, 0);
    received_.assign(size_, 0);
    totalSent_.assign(size_, 0);
    arrived_.assign(ranksOn.size(), 0);
    // A host's ranks that talk to the network share its bandwidth.
    std::vector<int> talkers(ranksOn.size(), 0);
    for (size_t r = 0; r < size_; ++r) {
      const bool talks = std::any_of(s_[r].begin(), s_[r].end(), [](const ScheduleStep& st) {
        return !st.local && (!st.sends.empty() || !st.receives.empty());
      });
      talkers[hostOf_[r]] += talks ? 1 : 0;
    }
    for (size_t r = 0; r < size_; ++r) {
      share_.push_back(cost.hostNetGBps / std::max(1, talkers[hostOf_[r]]));
    }
  }

  ScheduleReport run() {
    for (size_t r = 0; r < size_; ++r) ready_.push_back(static_cast<int>(r));
    while (!ready_.empty() && report_.error.empty()) {
      const int r = ready_.front();
      ready_.pop_front();
      enter(r);
    }
    if (report_.error.empty()) findStuck();
    for (size_t r = 0; r < size_; ++r) {
      report_.timeUs = std::max({report_.timeUs, clock_[r], railClock_[r]});
    }
    summarise();
    return report_;
  }

 private:
  struct Pending {
    int index;  // the message's number on its pair, for messages
    size_t bytes;
    int tag;
    double entry;  // when its rank entered the step
  };
  struct PairQueues {
    std::deque<Pending> sends, receives;
    int sentSoFar = 0;
  };

  static uint64_t key(int from, int to) {
    return static_cast<uint64_t>(static_cast<uint32_t>(from)) << 32 | static_cast<uint32_t>(to);
  }

  void fail(const std::string& what) {
    if (report_.error.empty()) report_.error = what;
  }

  // The clock of the thread that runs `step` on rank r: its rail thread's or its own.
  double& clockOf(int r, const ScheduleStep& step) {
    return step.onRail ? railClock_[r] : clock_[r];
  }

  // A marker between rank r's two threads (instantaneous).
  void mark(int r, const ScheduleStep& step) {
    std::vector<double>& done = railDone_[r];
    switch (step.marker) {
      case ScheduleStep::Marker::kRailStart:  // handed over: runs once the rail thread is free
        railClock_[r] = std::max(railClock_[r], clock_[r]);
        break;
      case ScheduleStep::Marker::kRailDone:
        if (done.size() <= step.job) done.resize(step.job + 1, 0);
        done[step.job] = railClock_[r];
        break;
      case ScheduleStep::Marker::kRailFinish:  // the collective's thread waits for the job
        clock_[r] = std::max(clock_[r], step.job < done.size() ? done[step.job] : 0.0);
        break;
      case ScheduleStep::Marker::kNone: break;
    }
  }

  // Runs rank r's steps from its current one until it must wait for others.
  void enter(int r) {
    const Schedule& steps = s_[r];
    while (pos_[r] < steps.size()) {
      const ScheduleStep& step = steps[pos_[r]];
      clockOf(r, step) += step.memoryBytes / (cost_.memGBps * 1e3);
      if (step.marker != ScheduleStep::Marker::kNone) mark(r, step);
      if (step.local) return arriveLocal(r);
      if (step.sends.empty() && step.receives.empty()) {
        ++pos_[r];
        continue;
      }
      remaining_[r] = step.sends.size() + step.receives.size();
      const double entry = clockOf(r, step);
      latest_[r] = entry;
      sent_[r] = received_[r] = 0;
      std::vector<std::pair<int, int>> pairs;
      for (const ScheduledMessage& m : step.sends) {
        if (m.peer < 0 || static_cast<size_t>(m.peer) >= size_ || hostOf_[m.peer] == hostOf_[r]) {
          return fail("rank " + std::to_string(r) + " sends over the network to rank " +
                      std::to_string(m.peer) + ", which is not on another host");
        }
        PairQueues& q = pairs_[key(r, m.peer)];
        q.sends.push_back({q.sentSoFar++, m.bytes, m.tag, entry});
        pairs.emplace_back(r, m.peer);
      }
      for (const ScheduledMessage& m : step.receives) {
        pairs_[key(m.peer, r)].receives.push_back({0, m.bytes, m.tag, entry});
        pairs.emplace_back(m.peer, r);
      }
      for (const auto& [from, to] : pairs) match(from, to);
      return;
    }
  }

  void match(int from, int to) {
    PairQueues& q = pairs_[key(from, to)];
    while (!q.sends.empty() && !q.receives.empty()) {
      const Pending s = q.sends.front();
      const Pending v = q.receives.front();
      if (s.bytes != v.bytes || s.tag != v.tag) {
        return fail("message " + std::to_string(s.index) + " from rank " + std::to_string(from) +
                    " to rank " + std::to_string(to) + " is " + std::to_string(s.bytes) +
                    " bytes for step " + std::to_string(s.tag) + " but the receiver expects " +
                    std::to_string(v.bytes) + " bytes for step " + std::to_string(v.tag));
      }
      q.sends.pop_front();
      q.receives.pop_front();
      ++report_.messages;
      sent_[from] += s.bytes;
      received_[to] += s.bytes;
      report_.maxSentBytes = std::max(report_.maxSentBytes, totalSent_[from] += s.bytes);
      latest_[from] = std::max(latest_[from], v.entry);
      latest_[to] = std::max(latest_[to], s.entry);
      for (int r : {from, to}) {
        if (--remaining_[r] == 0) finishExchange(r);
      }
    }
  }

  void finishExchange(int r) {
    const double bytes = static_cast<double>(std::max(sent_[r], received_[r]));
    clockOf(r, s_[r][pos_[r]]) = latest_[r] + cost_.netLatencyUs + bytes / (share_[r] * 1e3);
    ++pos_[r];
    ready_.push_back(r);
  }

  void arriveLocal(int r) {
    const int h = hostOf_[r];
    if (++arrived_[h] < static_cast<int>(ranksOn_[h].size())) return;
    arrived_[h] = 0;
    // Every rank of host h is at a local step: they must be the same one.
    const std::vector<int>& here = ranksOn_[h];
    const ScheduleStep& first = s_[here[0]][pos_[here[0]]];
    double start = 0;
    size_t bytes = 0;
    for (size_t j = 0; j < here.size(); ++j) {
      const int q = here[j];
      const ScheduleStep& step = s_[q][pos_[q]];
      if (step.collective != first.collective || step.digest != first.digest) {
        return fail("host " + std::to_string(h) + ": ranks " + std::to_string(here[0]) + " and " +
                    std::to_string(q) + " issue different local collectives at their steps " +
                    std::to_string(pos_[here[0]]) + " and " + std::to_string(pos_[q]));
      }
      if (step.collective == CollectiveKind::kAllToAll) {
        for (size_t k = 0; k < here.size(); ++k) {
          const ScheduleStep& other = s_[here[k]][pos_[here[k]]];
          if (step.sends.size() != here.size() || other.receives.size() != here.size() ||
              step.sends[k].bytes != other.receives[j].bytes) {
            return fail("host " + std::to_string(h) + ": local all_to_all counts of ranks " +
                        std::to_string(q) + " and " + std::to_string(here[k]) + " disagree");
          }
        }
      }
      start = std::max(start, clock_[q]);
      bytes = std::max(bytes, step.localBytes);
    }
    const double end = start + cost_.localLatencyUs + bytes / (cost_.localGBps * 1e3);
    for (int q : here) {
      clock_[q] = end;
      ++pos_[q];
      ready_.push_back(q);
    }
  }

  void findStuck() {
    std::string stuck;
    int shown = 0;
    for (size_t r = 0; r < size_; ++r) {
      if (pos_[r] == s_[r].size()) continue;
      if (shown++ < 4) {
        const ScheduleStep& step = s_[r][pos_[r]];
        stuck += " rank " + std::to_string(r) + " at step " + std::to_string(pos_[r]) +
                 (step.local ? " (local)" : " (exchange)") + ";";
      }
    }
    if (shown > 0) fail("deadlock: " + std::to_string(shown) + " ranks cannot go on:" + stuck);
  }

  void summarise() {
    std::vector<size_t> hostSent(ranksOn_.size(), 0);
    for (size_t r = 0; r < size_; ++r) {
      size_t network = 0;
      for (const ScheduleStep& step : s_[r]) {
        if (!step.local && (!step.sends.empty() || !step.receives.empty())) ++network;
      }
      report_.maxSteps = std::max(report_.maxSteps, s_[r].size());
      report_.maxNetworkSteps = std::max(report_.maxNetworkSteps, network);
      hostSent[hostOf_[r]] += totalSent_[r];
    }
    for (size_t b : hostSent) report_.maxHostSentBytes = std::max(report_.maxHostSentBytes, b);
  }

  const std::vector<std::vector<int>>& ranksOn_;
  const std::vector<Schedule>& s_;
  const CostModel cost_;
  const size_t size_;
  std::vector<int> hostOf_;
  std::vector<size_t> pos_;
  std::vector<double> clock_, railClock_, latest_, share_;  // ranks' and rail threads' clocks
  std::vector<std::vector<double>> railDone_;               // per rank: when each rail job ended
  std::vector<size_t> remaining_, sent_, received_;
  std::vector<size_t> totalSent_;  // over the whole schedule
  std::vector<int> arrived_;
  std::unordered_map<uint64_t, PairQueues> pairs_;
  std::deque<int> ready_;
  ScheduleReport report_;
};

}  // namespace

ScheduleReport checkSchedules(const std::vector<std::vector<int>>& ranksOn,
                              const std::vector<Schedule>& schedules, const CostModel& cost) {
  return Checker(ranksOn, schedules, cost).run();
}

}  // namespace loom
