// The network exchange of collectives across hosts, and the threads that share it.

#include "algorithms/network_context.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "algorithms/arriving_reduction.h"
#include "algorithms/call_stamp.h"
#include "loom/error.h"
#include "util/backoff.h"
#include "util/trace.h"

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;

// Exchanges that send at least this much (and receive too) hand their sends to the send
// thread: below it, the hand-off costs more than the overlap saves (a short round of halving
// waits for it), except in a pipeline's steps, which forward() hands over at any size.
constexpr size_t kOffloadBytes = size_t{256} << 10;

// A ring step's receive is reduced in parts of at least this many bytes as it lands, each
// part then free to go on (a frame is 128 KiB).
constexpr size_t kReducePartBytes = size_t{32} << 10;

// What ring()'s first step may send: all of it.
constexpr uint64_t kAllThere = ~uint64_t{0};

// How long a peer seen leaving mid-collective, or whose link broke, is given for the reason to
// arrive (a failure forwarded by its host), before it is reported as having issued fewer
// collectives or as lost.
constexpr auto kReasonGrace = std::chrono::milliseconds(100);

// The transfers of one exchange with one peer, each direction in order.
struct PeerWork {
  int peer = 0;
  MessageLink* link = nullptr;
  std::vector<const NetTransfer*> sends, receives;
  size_t nextSend = 0;
  uint64_t sent = 0;  // of the send being handed over
  bool drained = false;
  size_t nextReceive = 0;
  bool receiving = false;  // the next receive's envelope has been read
  size_t received = 0;     // of that receive
  std::optional<std::chrono::steady_clock::time_point> leftAt;  // when the peer was seen gone
  bool done() const { return drained && nextReceive == receives.size(); }
};

PeerWork& workFor(std::vector<PeerWork>& work, int peer) {
  for (PeerWork& w : work) {
    if (w.peer == peer) return w;
  }
  work.push_back({});
  work.back().peer = peer;
  return work.back();
}

// "rank 3 (host ...) (to receive 1024 more of 4096 bytes), ...": every peer an exchange still
// waits on, and for what (at most four named).
std::string outstandingOf(const std::vector<PeerWork>& work,
                          const std::function<std::string(int)>& describe) {
  constexpr size_t kNamed = 4;
  std::string text;
  size_t named = 0, more = 0;
  for (const PeerWork& w : work) {
    if (w.done()) continue;
    if (named == kNamed) {
      ++more;
      continue;
    }
    std::string what;
    if (w.nextReceive < w.receives.size()) {
      uint64_t left = w.receives[w.nextReceive]->bytes - w.received, total = 0;
      for (size_t r = w.nextReceive + 1; r < w.receives.size(); ++r) left += w.receives[r]->bytes;
      for (const NetTransfer* t : w.receives) total += t->bytes;
      what = "to receive " + std::to_string(left) + " more of " + std::to_string(total) + " bytes";
    } else if (w.nextSend < w.sends.size()) {
      uint64_t left = w.sends[w.nextSend]->bytes - w.sent, total = 0;
      for (size_t s = w.nextSend + 1; s < w.sends.size(); ++s) left += w.sends[s]->bytes;
      for (const NetTransfer* t : w.sends) total += t->bytes;
      what = "to send " + std::to_string(left) + " more of " + std::to_string(total) + " bytes";
    } else {
      what = "to take the bytes this rank sent";
    }
    text += std::string(named == 0 ? "" : ", ") + describe(w.peer) + " (" + what + ")";
    ++named;
  }
  if (more > 0) text += " and " + std::to_string(more) + " more";
  return text.empty() ? "nobody (a bug: tell loom's developers)" : text;
}

// Called when an exchange throws: the transfers' memory goes back to the collective's caller
// with the error, so no link may read it any more; every failure there fails the
// communicator, so closing a link's outbound side costs nothing.
void abandonSends(std::vector<PeerWork>& work) noexcept {
  for (PeerWork& w : work) {
    if (w.link != nullptr && !w.drained) w.link->abandonSends();
  }
}

}  // namespace

NetworkContext::~NetworkContext() {
  for (const auto& job : railJobs_) await(*job);
}

void NetworkContext::runLocal(const CollectiveArgs& args) {
  if (!runLocal_) {
    throw Error(ErrorCode::kInternal, wait_.op, layout().rank,
                "a rail job asked for a local collective (only the collective's own thread "
                "may run those)");
  }
  runLocal_(args);
}

std::shared_ptr<NetworkContext::Job> NetworkContext::handOff(Worker& thread,
                                                             std::function<void()> fn) {
  auto job = std::make_shared<Job>();
  thread.submit([job, fn = std::move(fn)] {
    try {
      fn();
    } catch (...) {
      job->error = std::current_exception();
    }
    job->done.store(true, std::memory_order_release);
  });
  return job;
}

void NetworkContext::await(const Job& job) {
  const trace::Span span("wait for a hand-off");
  // The job ends by itself (it watches the failure record and the deadline): spin for a
  // short one, then yield, then sleep a little at a time.
  for (int turn = 0; !job.done.load(std::memory_order_acquire); ++turn) {
    if (turn < 256) {
      cpuRelax();
    } else if (turn < 2048) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

size_t NetworkContext::startRail(RailSteps steps, int lane) {
  const NetLane& on = lanes_.at(static_cast<size_t>(lane));
  if (!on.rail || !on.railScratch) {
    // No rail thread here: the job runs now, on this thread, and is over.
    auto job = std::make_shared<Job>();
    try {
      steps(*this);
    } catch (...) {
      job->error = std::current_exception();
    }
    job->done.store(true, std::memory_order_release);
    railJobs_.push_back(std::move(job));
    return railJobs_.size() - 1;
  }
  // The job's own context: its lane's links, send thread and scratch, and no local
  // collectives (those are this thread's).
  auto job = handOff(*on.rail, [this, &on, steps = std::move(steps), n = railJobs_.size()] {
    const trace::Span span("rail job", n);
    NetworkContext own(layout(), *on.railScratch, nullptr, describe_, failures_, wait_, stamp_,
                       {NetLane{on.linkTo, on.sends, nullptr, nullptr}});
    steps(own);
  });
  railJobs_.push_back(std::move(job));
  return railJobs_.size() - 1;
}

void NetworkContext::finishRail(size_t ticket) {
  const Job& job = *railJobs_.at(ticket);
  await(job);
  if (job.error) std::rethrow_exception(job.error);
}

void NetworkContext::failWith(ErrorCode code, int q, const std::string& message) {
  failures_.fail(code, q, message);
  throw failures_.failureError(wait_.op);
}

void NetworkContext::exchange(std::span<const NetTransfer> sends,
                              std::span<const NetTransfer> receives) {
  size_t sending = 0;
  for (const NetTransfer& t : sends) sending += t.bytes;
  if (!sends_ || receives.empty() || sending < kOffloadBytes) return drive(sends, receives);
  sendBeside(sends, receives);
}

void NetworkContext::forward(const NetTransfer& send, const NetTransfer& receive) {
  if (!sends_) return drive({&send, 1}, {&receive, 1});
  sendBeside({&send, 1}, {&receive, 1});
}

void NetworkContext::ring(std::span<const RingStep> steps, const kernels::ReduceSpec& spec) {
  // Cut through only where a step's block spans frames and exchange() would hand its send to
  // the send thread: smaller blocks cannot go on before they are whole anyway, and there a
  // ring that streamed its steps (on one thread or two) was slower than one going a step at
  // a time (measured, docs/PERFORMANCE.md "A ring that cuts through"). And only a chain of
  // steps with one pair of neighbours, each sending what the one before produced.
  size_t largest = 0;
  for (const RingStep& step : steps) largest = std::max(largest, step.send.bytes);
  bool chained = sends_ != nullptr && largest >= kOffloadBytes && steps.size() >= 2;
  for (size_t s = 1; chained && s < steps.size(); ++s) {
    const RingStep& before = steps[s - 1];
    const void* produced = before.into != nullptr ? before.into : before.receive.data;
    chained = steps[s].send.data == produced && steps[s].send.bytes == before.receive.bytes &&
              steps[s].send.peer == steps[0].send.peer &&
              steps[s].receive.peer == steps[0].receive.peer;
  }
  if (!chained) return AcrossHostsContext::ring(steps, spec);

  std::vector<NetTransfer> sends, receives;
  for (const RingStep& step : steps) {
    sends.push_back(step.send);
    receives.push_back(step.receive);
  }
  // produced[s]: bytes of step s's result that are final (reduced), published by the
  // receiving thread for the sending one. Sends are drained only at the end, yet a step may
  // receive into memory an earlier step sent from (the all-gather into the blocks the
  // reduce-scatter sent): that is safe because each byte arriving there depends, around the
  // ring, on the earlier byte at its place having been delivered.
  std::vector<std::atomic<uint64_t>> produced(steps.size());
  // A step that reduces takes its whole elements straight out of the link's frames, sparing
  // the receiving thread a copy of each (docs/PERFORMANCE.md, "Reduced where it lands").
  std::vector<std::optional<ArrivingReduction>> reductions(steps.size());
  for (size_t s = 0; s < steps.size(); ++s) {
    const RingStep& step = steps[s];
    if (step.into == nullptr) continue;
    reductions[s].emplace(step.into, step.receive.data, step.receive.bytes, elementSize(spec.type),
                          kReducePartBytes,
                          [this, &spec](void* dst, const void* src, size_t count) {
                            const void* srcs[2] = {dst, src};
                            reduce(dst, srcs, count, spec);
                          });
  }
  std::atomic<bool> abandoned{false};
  const Streaming streaming{
      [&](size_t s) {
        return s == 0 ? kAllThere : produced[s - 1].load(std::memory_order_acquire);
      },
      [&](size_t s, size_t at, std::span<const uint8_t> view) {
        if (reductions[s]) return reductions[s]->take(at, view);
        const trace::Span span("copy out of a frame", view.size());
        std::memcpy(static_cast<uint8_t*>(steps[s].receive.data) + at, view.data(), view.size());
      },
      [&](size_t s, size_t landed) {
        produced[s].store(reductions[s] ? reductions[s]->landed(landed) : landed,
                          std::memory_order_release);
      },
      &abandoned};
  sendBeside(sends, receives, &streaming);
}

void NetworkContext::sendBeside(std::span<const NetTransfer> sends,
                                std::span<const NetTransfer> receives, const Streaming* streaming) {
  // Make every link here first: the send thread must not create them beside this one.
  for (const NetTransfer& t : sends) linkTo_(t.peer);
  for (const NetTransfer& t : receives) linkTo_(t.peer);
  auto out = handOff(*sends_, [&] { drive(sends, {}, streaming); });
  try {
    drive({}, receives, streaming);
  } catch (...) {
    // The send thread ends too: every failure here is recorded for every thread, and a
    // send waiting for bytes this thread would have produced gives up on the flag.
    if (streaming != nullptr) streaming->abandoned->store(true, std::memory_order_release);
    await(*out);
    throw;
  }
  await(*out);
  if (out->error) std::rethrow_exception(out->error);
}

void NetworkContext::drive(std::span<const NetTransfer> sends,
                           std::span<const NetTransfer> receives, const Streaming* streaming) {
  size_t bytes = 0;
  for (const NetTransfer& t : sends) bytes += t.bytes;
  for (const NetTransfer& t : receives) bytes += t.bytes;
  const trace::Span span(sends.empty() ? "receive" : receives.empty() ? "send" : "exchange", bytes);
  std::vector<PeerWork> work;
  for (const NetTransfer& t : sends) workFor(work, t.peer).sends.push_back(&t);
  for (const NetTransfer& t : receives) workFor(work, t.peer).receives.push_back(&t);
  const std::string op(wait_.op);
  size_t left = work.size();
  size_t idleTurns = 0;
  // While tracing, each idle stretch is a span: waiting for bytes this process still has to
  // produce (a ring's send), or for the network (arrivals, credits).
  std::optional<trace::Span> idle;
  int current = -1;  // the peer being driven, for failure messages
  try {
    for (PeerWork& w : work) {
      current = w.peer;
      w.link = &linkTo_(w.peer);
      w.drained = w.sends.empty();  // a receiving thread leaves the outbound side alone
    }
    while (left > 0) {
      if (failures_.failed()) throw failures_.failureError(op);
      if (streaming != nullptr && streaming->abandoned->load(std::memory_order_acquire)) {
        throw Error(ErrorCode::kInternal, op, layout().rank,
                    "the ring's receiving side failed before producing what this send needs");
      }
      bool progressed = false;
      bool awaitsProduction = false;  // a send waits for bytes this process is producing
      for (PeerWork& w : work) {
        if (w.done()) continue;
        current = w.peer;
        MessageLink& link = *w.link;
        // Sends: each handed over in turn; the peer's part is done once the link has
        // drained. A network link moves queued frames only while driven, and the peer may be
        // waiting for them before it sends what this rank waits for (a ring of three or
        // more hosts), so a send counts only once it has left. Until then the link may
        // send from the transfer's memory itself (borrowed, no copy): this returns only
        // once drained, or abandons the sends when it throws.
        while (w.nextSend < w.sends.size()) {
          const NetTransfer& t = *w.sends[w.nextSend];
          const uint64_t before = w.sent;
          const auto* payload = static_cast<const uint8_t*>(t.data);
          bool handedOver = false;
          if (streaming == nullptr) {
            handedOver = link.writeBorrowed({t.tag, t.bytes, stamp_}, payload, w.sent);
          } else {
            const uint64_t ready =
                streaming->ready(static_cast<size_t>(w.sends[w.nextSend] - sends.data()));
            handedOver = link.writeBorrowedPrefix({t.tag, t.bytes, stamp_}, payload, w.sent, ready);
            awaitsProduction |= !handedOver && ready < t.bytes;
          }
          progressed |= w.sent != before || handedOver;
          if (!handedOver) break;
          ++w.nextSend;
          w.sent = 0;
        }
        if (w.nextSend == w.sends.size() && !w.drained && link.drained()) {
          w.drained = true;
          progressed = true;
        }
        // Receives, in order.
        while (w.nextReceive < w.receives.size() && link.readable()) {
          const NetTransfer& t = *w.receives[w.nextReceive];
          if (!w.receiving) {
            const std::optional<Envelope> envelope = link.nextEnvelope();
            if (!envelope) break;
            if (envelope->stamp != stamp_) {
              failWith(ErrorCode::kMismatch, t.peer,
                       op + " #" + std::to_string(wait_.seq) + ": " +
                           explainStamps(envelope->stamp, stamp_, wait_.seq, describe_(t.peer)));
            }
            if (envelope->tag != t.tag || envelope->bytes != t.bytes) {
              failWith(ErrorCode::kMismatch, t.peer,
                       op + " #" + std::to_string(wait_.seq) + ": " + describe_(t.peer) + " sent " +
                           std::to_string(envelope->bytes) + " bytes for step " +
                           std::to_string(envelope->tag) + " where this rank expected " +
                           std::to_string(t.bytes) + " for step " + std::to_string(t.tag) +
                           ": the ranks issued different collectives, counts or types");
            }
            w.receiving = true;
            progressed = true;
          }
          const size_t r = static_cast<size_t>(w.receives[w.nextReceive] - receives.data());
          std::span<const uint8_t> view;
          if (streaming != nullptr) view = link.peek(t.bytes - w.received);
          size_t n = 0;
          if (!view.empty()) {  // a frame's worth at most: taken, then let go of
            streaming->take(r, w.received, view);
            n = link.read(nullptr, view.size());
          } else {
            n = link.read(static_cast<uint8_t*>(t.data) + w.received, t.bytes - w.received);
          }
          w.received += n;
          progressed |= n > 0;
          if (streaming != nullptr && n > 0) streaming->landed(r, w.received);
          if (w.received < t.bytes) {
            if (!view.empty()) continue;  // the next frame may be here too
            break;
          }
          ++w.nextReceive;
          w.receiving = false;
          w.received = 0;
        }
        if (w.done()) {
          --left;
          continue;
        }
        // A peer that destroyed its communicator: what this rank still expects of it will
        // never come, and what it still sends has nobody to take it. A peer whose
        // communicator failed leaves the same way, right after its host forwarded the
        // failure on the control link (read every few milliseconds): the failure, once it
        // arrives, is the reason; a peer that left without one issued fewer collectives.
        const bool waitsToReceive = w.nextReceive < w.receives.size();
        // One that left before it ever connected to this rank (its communicator shut down
        // before any collective with it) has no link to say so on: its host's control link
        // did (ControlPlane), and nothing can be in flight from it.
        // So did one a send-only step writes to over a link first made after it left (its
        // service still takes the connection, and the first frames' credits).
        const bool leftUnmet =
            failures_.saidGoodbye(w.peer) && (!waitsToReceive || !link.inboundMade());
        if ((waitsToReceive && link.inboundEnded() && !link.readable()) ||
            (!waitsToReceive && link.outboundEnded()) || leftUnmet) {
          const auto now = Clock::now();
          if (!w.leftAt) w.leftAt = now;
          if (now - *w.leftAt >= kReasonGrace) {
            failures_.peerGone(w.peer, RankState::kDeparted, wait_);
          }
        }
      }
      if (progressed) {
        idle.reset();
        idleTurns = 0;
        continue;
      }
      // Idle: a short spin, then yield, then sleep a little (the network rings no bell).
      if (Clock::now() >= wait_.deadline) {
        // The peer waited for may itself wait for a rank behind it, whose own host names that
        // rank at about the same moment (its deadline is this call's too) and forwards the
        // reason: that is the one to report, not the healthy peer this rank waited on.
        if (failureWithin(failures_, kTimeoutReasonGrace)) throw failures_.failureError(op);
        failWith(ErrorCode::kTimeout, current,
                 op + " #" + std::to_string(wait_.seq) + " hit its timeout of " +
                     std::to_string(wait_.timeout.count()) + " ms waiting over the network for " +
                     outstandingOf(work, describe_) +
                     " (which may itself wait for a rank behind it: the flight record and the "
                     "other hosts' reports say where each rank was)");
      }
      if (idleTurns++ == 0 && trace::enabled()) {
        idle.emplace(awaitsProduction ? "wait for bytes to send" : "wait on the network");
      }
      // A cut-through ring's two threads feed each other within a frame's time: a send
      // waits for what this process's other thread is receiving and reducing, and that
      // thread for frames its predecessor's send thread passes on as they are produced. A
      // nap (50 µs, often twice that with the kernel's timer slack) would stall every hop of
      // the ring, so both keep yielding (docs/PERFORMANCE.md, "A ring's receiver that does
      // not nap"); other exchanges nap soon, leaving the cores to threads with work.
      const bool ringReceiver = streaming != nullptr && !receives.empty();
      if (idleTurns < ((awaitsProduction || ringReceiver) ? 4096 : 64)) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  } catch (const Error& e) {
    abandonSends(work);
    if (e.code() == ErrorCode::kPeerFailure && current >= 0) {
      // A link broke (or its peer's listener is gone). A peer that failed (a mismatch it
      // found, say) leaves at once, and its reason reaches this host over the control plane
      // within milliseconds, maybe before this link noticed: that reason is the error to
      // report, not the refused connection it left behind. Without one soon, name the peer:
      // as departed where its host's control link said goodbye for it (a peer that destroyed
      // its communicator closes its links right after their goodbyes, and a send failing on
      // the closed connection can be read before the goodbye behind it), else as lost.
      if (!failureWithin(failures_, kReasonGrace)) {
        if (failures_.saidGoodbye(current) || failures_.stateOf(current) == RankState::kDeparted) {
          failures_.peerGone(current, RankState::kDeparted, wait_);
        }
        failures_.peerLost(current, e.detail());
      }
      throw failures_.failureError(op);
    }
    throw;
  } catch (...) {
    abandonSends(work);
    throw;
  }
}

}  // namespace loom
