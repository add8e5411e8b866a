// The point-to-point engine: ring streaming, tag matching, deadlines.

#include "core/p2p_engine.h"

#include <sched.h>

#include <algorithm>
#include <cstring>

#include "loom/communicator.h"
#include "util/backoff.h"
#include "util/deadline.h"
#include "util/posix.h"

namespace loom {

namespace {

bool matches(int wantPeer, int wantTag, int source, int tag) {
  return (wantPeer == kAnySource || wantPeer == source) && wantTag == tag;
}

thread_local const void* tOwnGate = nullptr;  // the Gate of the engine whose thread this is

}  // namespace

P2pEngine::P2pEngine(int rank, shm::ShmComm& shm, Failures& failures,
                     std::vector<std::unique_ptr<MessageLink>> links, detail::FailureSink* sink)
    : shm_(shm),
      failures_(failures),
      sink_(sink),
      rank_(rank),
      size_(static_cast<int>(links.size())),
      gate_(std::make_shared<Gate>()),
      links_(std::move(links)) {
  for (const auto& link : links_) polls_ |= link->polled();
  gate_->engine = this;
  outbound_.resize(static_cast<size_t>(size_));
  inbound_.resize(static_cast<size_t>(size_));
  thread_ = std::thread([this] {
    posix::nameThisThread("loom-p2p");
    tOwnGate = gate_.get();
    detail::markWaitsMustDrive();
    run();
  });
}

P2pEngine::~P2pEngine() {
  stopping_.store(true, std::memory_order_release);
  shm_.ringDoorbell(shm_.rank());
  thread_.join();
  // A waiter still holding one of this engine's (now ended) operations must not take a turn,
  // and one marking operations it ended must be done telling the communicator, which goes
  // right after this engine.
  std::unique_lock<std::mutex> lock(gate_->mutex);
  gate_->engine = nullptr;
  gate_->marked.wait(lock, [this] { return gate_->marking == 0; });
}

Error P2pEngine::opError(ErrorCode code, const Op& op, bool isSend, const std::string& what) const {
  std::string peer = op.peer == kAnySource ? "any rank" : "rank " + std::to_string(op.peer);
  const std::string said = std::string(isSend ? "to " : "from ") + peer + " (tag " +
                           std::to_string(op.tag) + ", " + std::to_string(op.bytes) + " bytes): ";
  // A failure this very operation caused already says which it is (failAll passes it on).
  return Error(code, isSend ? "send" : "recv", rank_, what.starts_with(said) ? what : said + what);
}

Request P2pEngine::send(const void* data, size_t bytes, int peer, int tag,
                        std::chrono::milliseconds timeout, uint64_t flightId) {
  // The engine only reads a send's data; Op keeps one pointer type for both directions.
  return post(newSends_, const_cast<void*>(data), bytes, peer, tag, timeout, flightId);
}

Request P2pEngine::recv(void* data, size_t bytes, int peer, int tag,
                        std::chrono::milliseconds timeout, uint64_t flightId) {
  return post(newRecvs_, data, bytes, peer, tag, timeout, flightId);
}

Request P2pEngine::post(std::vector<std::shared_ptr<Op>>& queue, void* data, size_t bytes, int peer,
                        int tag, std::chrono::milliseconds timeout, uint64_t flightId) {
  auto op = std::make_shared<Op>();
  op->state = std::make_shared<detail::OpState>(++nextSeq_);
  op->state->flightId = flightId;
  op->state->sink = sink_;
  op->state->startedAt = Clock::now();
  op->data = static_cast<uint8_t*>(data);
  op->bytes = bytes;
  op->peer = peer;
  op->tag = tag;
  op->timeout = timeout;
  op->deadline = deadlineAfter(timeout, op->state->startedAt);
  // Small operations are driven by their caller; larger ones by the engine's thread alone,
  // as before callers drove any: on the 16-core host, with callers driving every size, 16
  // of 18 exchanges of 256 KiB to 1 MiB took longer (up to 1.7x; two threads taking turns
  // of one engine while a message streams through the ring), where an 8-byte one took
  // 0.58-0.96x the time (PERFORMANCE.md, "Send and receive on CPU tensors").
  const bool callerDriven = bytes <= kCallerDrivenBytes;
  op->state->progress = [gate = gate_, callerDriven](bool slept) {
    return gate->progress(callerDriven, slept);
  };
  Request request(op->state);
  {
    std::lock_guard<std::mutex> lock(inboxMutex_);
    queue.push_back(std::move(op));
  }
  // A small send, or a small receive whose message is here, ends in this turn; only what is
  // left (or what a busy gate kept from this turn) needs the engine's thread, which also
  // watches its deadline.
  if (callerDriven) gate_->progress(true, false);
  if (!request.test()) shm_.ringDoorbell(shm_.rank());
  return request;
}

bool P2pEngine::Gate::progress(bool anyThread, bool expire) {
  // On the engine's own thread a completion callback waits: nothing else watches deadlines.
  const bool own = tOwnGate == this;
  if (!anyThread && !own && !expire) return false;
  std::vector<Finished> finished;
  bool progressed = false;
  {
    std::unique_lock<std::mutex> lock(mutex, std::try_to_lock);
    if (!lock.owns_lock() || engine == nullptr) return false;
    if (anyThread || own) progressed = engine->turn();
    if (own || expire) engine->expire(Clock::now());
    // The engine is going (its destructor waits for this thread): a callback waiting here
    // must not hold it to that operation's deadline.
    if (own && engine->stopping_.load(std::memory_order_acquire)) {
      engine->failAll(Error(ErrorCode::kAborted, "send/recv", engine->rank_,
                            "the communicator was shut down while this operation was pending"));
    }
    finished.swap(engine->finished_);
    if (!finished.empty()) ++marking;
  }
  if (finished.empty()) return progressed;
  std::vector<detail::OpState::Callbacks> callbacks;
  {
    // The callbacks may drop the communicator: they run once this thread no longer counts
    // (counted off however the marking ends, so the engine's destructor never waits for good).
    struct CountedOff {
      Gate& gate;
      ~CountedOff() {
        std::lock_guard<std::mutex> lock(gate.mutex);
        if (--gate.marking == 0) gate.marked.notify_all();
      }
    } countedOff{*this};
    callbacks = markEnded(finished);
  }
  runCallbacks(finished, callbacks);
  return progressed;
}

void P2pEngine::waitForSends(std::chrono::milliseconds atMost) {
  const auto until = deadlineAfter(atMost);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(gate_->mutex);
      if (!sendsPending() || Clock::now() >= until) return;
    }
    // The engine's thread moves them on and ends them at their deadlines.
    shm_.ringDoorbell(shm_.rank());
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

bool P2pEngine::sendsPending() {
  for (const auto& queue : outbound_)
    if (!queue.empty()) return true;
  std::lock_guard<std::mutex> lock(inboxMutex_);
  return !newSends_.empty();
}

void P2pEngine::finish(Op& op, std::exception_ptr error) {
  finished_.push_back({op.state, std::move(error)});
}

void P2pEngine::complete(std::vector<Finished>& finished) {
  // Every one marked before any callback runs: a callback may wait on another of them.
  std::vector<detail::OpState::Callbacks> callbacks = markEnded(finished);
  runCallbacks(finished, callbacks);
}

std::vector<detail::OpState::Callbacks> P2pEngine::markEnded(std::vector<Finished>& finished) {
  std::vector<detail::OpState::Callbacks> callbacks;
  callbacks.reserve(finished.size());
  for (Finished& f : finished) callbacks.push_back(f.state->finish(f.error));
  return callbacks;
}

void P2pEngine::runCallbacks(std::vector<Finished>& finished,
                             std::vector<detail::OpState::Callbacks>& callbacks) {
  for (size_t i = 0; i < finished.size(); ++i) {
    detail::OpState::runCallbacks(std::move(callbacks[i]), finished[i].error);
  }
  finished.clear();
}

bool P2pEngine::turn() {
  if (failures_.failed()) failAll(failures_.failureError("send/recv"));
  bool progressed = acceptNewOps();
  progressed |= progressSends();
  progressed |= progressReceives();
  return progressed;
}

void P2pEngine::run() {
  bool rung = true;  // the last sleep ended with a ring (or there was none yet)
  std::vector<Finished> finished;
  for (;;) {
    const uint32_t seen = shm_.doorbellRings();
    bool progressed = false;
    bool deadlines = false;
    {
      std::lock_guard<std::mutex> lock(gate_->mutex);
      progressed = turn();
      expire(Clock::now());
      deadlines = !progressed && hasDeadlines();  // read only by the sleep after an idle turn
      finished.swap(finished_);
    }
    complete(finished);
    if (stopping_.load(std::memory_order_acquire)) break;
    if (progressed) {
      rung = true;
      continue;
    }
    rung = sleepUntilRung(seen, rung, deadlines);
  }
  {
    std::lock_guard<std::mutex> lock(gate_->mutex);
    failAll(Error(ErrorCode::kAborted, "send/recv", rank_,
                  "the communicator was shut down while this operation was pending"));
    finished.swap(finished_);
  }
  complete(finished);
}

bool P2pEngine::sleepUntilRung(uint32_t seen, bool spin, bool deadlines) {
  // Idle: back off until a doorbell ring (new op, data in, space freed). Network links ring
  // no doorbell, so with any of them the sleep is short and the links are looked at after.
  // TODO(issue 11): wake on the fabric's completion fds instead of polling every slice.
  constexpr auto kNetworkSlice = std::chrono::milliseconds(1);
  // Spin first only when work was just done or a ring just came (more is likely soon); after
  // a sleep that ran out its slice, sleep again at once (it used to spin and yield for 220 us
  // every 50 ms slice while idle). Spinning after a ring whose work a caller's thread took
  // first (OpState::progress) looks wasted, but sleeping at once was slower in back-to-back
  // runs on the 2-core VM (an 8-byte exchange between two ranks: 76-97 us with the spin,
  // 116-136 without): asleep at each ring, the engine cost every message a futex wake.
  Backoff backoff(shm_.backoff());
  while (spin && shm_.doorbellRings() == seen && !stopping_.load(std::memory_order_acquire)) {
    const auto stage = backoff.next();
    if (stage == Backoff::Stage::kSleep) break;
    if (stage == Backoff::Stage::kSpin)
      cpuRelax();
    else
      sched_yield();
  }
  if (shm_.doorbellRings() != seen || stopping_.load(std::memory_order_acquire)) return true;
  // How long to sleep: polled links need a look every 1 ms, pending operations' deadlines
  // one every slice; with neither, until rung. Failures (ShmComm::wakeAll), new ops, arriving
  // data and the destructor all ring, so a timer would only wake an idle engine for nothing,
  // and on a machine with a rank per core every such wake-up takes a core a rank needs.
  constexpr auto kUntilRung = std::chrono::hours(1);
  const auto slice = polls_      ? std::chrono::nanoseconds(kNetworkSlice)
                     : deadlines ? std::chrono::nanoseconds(shm_.backoff().sleepSlice)
                                 : std::chrono::nanoseconds(kUntilRung);
  shm_.sleepOnDoorbell(seen, slice);
  return shm_.doorbellRings() != seen;  // else the slice ran out: re-check deadlines, links
}

bool P2pEngine::hasDeadlines() const {
  if (!posted_.empty()) return true;
  for (const auto& queue : outbound_)
    if (!queue.empty()) return true;
  for (const auto& in : inbound_)
    if (in.active && in.recv) return true;
  for (const auto& message : unexpected_)
    if (message->claimedBy) return true;
  return false;
}

bool P2pEngine::acceptNewOps() {
  std::vector<std::shared_ptr<Op>> sends;
  std::vector<std::shared_ptr<Op>> recvs;
  {
    std::lock_guard<std::mutex> lock(inboxMutex_);
    sends.swap(newSends_);
    recvs.swap(newRecvs_);
  }
  for (auto& op : sends) outbound_[op->peer].push_back(std::move(op));
  for (auto& op : recvs) postReceive(op);
  return !sends.empty() || !recvs.empty();
}

bool P2pEngine::progressSends() {
  bool progressed = false;
  for (int q = 0; q < size_; ++q) {
    auto& queue = outbound_[q];
    bool wrote = false;
    while (!queue.empty()) {
      Op& op = *queue.front();
      // A receiver that is gone takes nothing more (expire() fails what waits for it): writing
      // a small message into its ring would report a send that nobody will ever receive.
      if (op.done == 0 && receiverGone(q)) break;
      const uint64_t before = op.done;
      bool complete = false;
      try {
        complete = links_[q]->write({op.tag, op.bytes}, op.data, op.done);
      } catch (const Error& e) {
        linkFailed(q, e);
        return true;  // failAll picks everything up on the next turn
      } catch (const std::exception& e) {
        // Anything else (a connection's set-up out of memory or threads) fails the
        // communicator with its cause rather than end the process: nothing above catches it.
        failures_.fail(ErrorCode::kSystem, q,
                       "sending to rank " + std::to_string(q) + " broke off: " + e.what());
        return true;
      }
      wrote |= op.done != before;
      if (!complete) break;  // the link is full
      finish(op, nullptr);
      queue.pop_front();
    }
    if (wrote) {
      links_[q]->notifyPeer();
      progressed = true;
    }
  }
  return progressed;
}

void P2pEngine::linkFailed(int q, const Error& e) {
  // Only a broken link or a peer gone is the peer's; a failure on this side (out of
  // descriptors or memory) is this rank's, and the peer must not be reported lost for it.
  if (e.code() == ErrorCode::kPeerFailure) {
    failures_.peerLost(q, e.detail());
  } else {
    failures_.fail(e.code(), rank_, e.detail());
  }
}

bool P2pEngine::progressReceives() {
  bool progressed = false;
  for (int source = 0; source < size_; ++source) {
    try {
      progressed |= drain(source);
    } catch (const Error& e) {
      // A corrupt stream is loom's bug (kInternal).
      if (e.code() == ErrorCode::kInternal) {
        failures_.fail(e.code(), source, e.detail());
      } else {
        linkFailed(source, e);
      }
      return true;  // failAll picks everything up on the next turn
    } catch (const std::exception& e) {
      // Anything else (the engine's thread has no one above it to catch it) fails the
      // communicator with its cause rather than end the process.
      failures_.fail(ErrorCode::kSystem, source,
                     "receiving from rank " + std::to_string(source) + " broke off: " + e.what());
      return true;
    }
  }
  return progressed;
}

bool P2pEngine::drain(int source) {
  MessageLink& link = *links_[source];
  Inbound& in = inbound_[source];
  bool consumed = false;
  while (link.readable()) {
    consumed = true;
    if (!in.active) {
      const std::optional<Envelope> envelope = link.nextEnvelope();
      if (!envelope) break;  // the rest of the envelope is still on its way
      startMessage(source, in, *envelope);
      if (in.payloadLeft == 0) finishMessage(source, in);
      continue;
    }
    const size_t n = link.read(in.target, in.payloadLeft);
    if (n == 0) break;
    if (in.target != nullptr) in.target += n;
    if (in.unexpected) in.unexpected->received += n;
    in.payloadLeft -= n;
    if (in.payloadLeft == 0) finishMessage(source, in);
  }
  if (consumed) link.notifyPeer();  // the sender may be waiting for space
  // Its goodbye comes after everything it sent on this direction: every receive waiting on
  // it ends now (expire()). Not the goodbye of the other direction's channel (peerLeft()),
  // which a peer closing its links may say while its last message to this rank is on its way.
  if (link.inboundEnded()) failures_.peerLeft(source);
  return consumed;
}

void P2pEngine::startMessage(int source, Inbound& in, const Envelope& envelope) {
  const int tag = envelope.tag;
  const uint64_t bytes = envelope.bytes;
  in.active = true;
  in.bytes = bytes;
  in.payloadLeft = bytes;
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    Op& op = **it;
    if (!matches(op.peer, op.tag, source, tag)) continue;
    in.recv = *it;
    posted_.erase(it);
    op.state->source.store(source);
    // A message that fits goes to the front of the buffer (the rest keeps its bytes, as Gloo
    // and MPI leave it); a larger one is discarded and fails the receive.
    in.target = bytes <= op.bytes ? op.data : nullptr;
    return;
  }
  auto message = std::make_shared<Unexpected>();
  message->source = source;
  message->tag = tag;
  try {
    message->data.resize(bytes);
  } catch (const std::bad_alloc&) {
    // The message is lost (its bytes are read and dropped): whoever waits for it, on either
    // side, must hear why rather than wait for it.
    in.target = nullptr;
    failures_.fail(ErrorCode::kSystem, source,
                   "could not hold a message of " + std::to_string(bytes) + " bytes (tag " +
                       std::to_string(tag) + ") from rank " + std::to_string(source) +
                       " that arrived before its receive was posted: out of memory; post the "
                       "receive of a large message before it arrives");
    return;
  }
  in.unexpected = message;
  in.target = message->data.data();
  unexpected_.push_back(std::move(message));
}

std::exception_ptr P2pEngine::tooLarge(const Op& op, int source, uint64_t bytes) const {
  return std::make_exception_ptr(opError(
      ErrorCode::kInvalidArgument, op, false,
      "the matching message from rank " + std::to_string(source) + " has " + std::to_string(bytes) +
          " bytes, more than this recv's buffer holds; receive into a "
          "buffer at least as large as what is sent"));
}

void P2pEngine::finishMessage(int source, Inbound& in) {
  const uint64_t bytes = in.bytes;
  if (in.recv) {
    Op& op = *in.recv;
    finish(op, bytes <= op.bytes ? nullptr : tooLarge(op, source, bytes));
  } else if (in.unexpected && in.unexpected->claimedBy) {
    deliver(*in.unexpected, *in.unexpected->claimedBy);
    unexpected_.remove(in.unexpected);
  }
  in = Inbound{};
}

void P2pEngine::deliver(Unexpected& message, Op& op) {
  op.state->source.store(message.source);
  if (message.data.size() > op.bytes) {
    finish(op, tooLarge(op, message.source, message.data.size()));
    return;
  }
  if (!message.data.empty()) std::memcpy(op.data, message.data.data(), message.data.size());
  finish(op, nullptr);
}

void P2pEngine::postReceive(const std::shared_ptr<Op>& op) {
  for (auto it = unexpected_.begin(); it != unexpected_.end(); ++it) {
    Unexpected& message = **it;
    if (message.claimedBy || !matches(op->peer, op->tag, message.source, message.tag)) continue;
    if (message.received == message.data.size()) {
      deliver(message, *op);
      unexpected_.erase(it);
    } else {
      message.claimedBy = op;  // finishMessage delivers it when the rest arrives
    }
    return;
  }
  posted_.push_back(op);
}

void P2pEngine::expire(Clock::time_point now) {
  if (failures_.failed()) return;  // failAll ends everything with the recorded reason
  // Sends cancelled before any of them went out (Request::cancel): the stream has nothing
  // of them, so they simply leave the queue.
  for (auto& queue : outbound_) {
    for (auto it = queue.begin(); it != queue.end();) {
      Op& op = **it;
      if (op.done != 0 || !op.state->cancelAsked.load(std::memory_order_acquire)) {
        ++it;
        continue;
      }
      finish(op, std::make_exception_ptr(
                     opError(ErrorCode::kAborted, op, true, "aborted before any of it was sent")));
      it = queue.erase(it);
    }
  }
  // Receives with no message yet: they end at their deadline, or at once if their sender
  // is gone and nothing more can arrive from it.
  for (auto it = posted_.begin(); it != posted_.end();) {
    Op& op = **it;
    std::string why;
    ErrorCode code = ErrorCode::kTimeout;
    if (op.state->cancelAsked.load(std::memory_order_acquire)) {
      code = ErrorCode::kAborted;
      why = "aborted before any of its message arrived";
    } else if (op.peer != kAnySource && senderGone(op.peer) && !stillReadable(op.peer) &&
               !inbound_[op.peer].active) {
      code = ErrorCode::kPeerFailure;
      why = failures_.stateOf(op.peer) == RankState::kDead
                ? "the sender's process exited"
                : "the sender destroyed its communicator without sending it";
    } else if (now >= op.deadline) {
      why = "no matching message arrived within " + std::to_string(op.timeout.count()) + " ms";
    }
    if (why.empty()) {
      ++it;
      continue;
    }
    finish(op, std::make_exception_ptr(opError(code, op, false, why)));
    it = posted_.erase(it);
  }
  // Messages part-way in: one whose sender left, with nothing more to read from it, will
  // never see its end, nor will one going straight into a receive whose deadline passed,
  // and the channel cannot be read past the gap: the communicator fails, naming the sender
  // (as a send cut off does), whether a receive took the message or it was being held for
  // one (else every later receive from that sender would wait out its whole timeout).
  for (int q = 0; q < size_; ++q) {
    const Inbound& in = inbound_[q];
    if (!in.active) continue;
    const RankState state = failures_.stateOf(q);
    const bool gone = state != RankState::kAlive && !stillReadable(q);
    const bool late = in.recv && now >= in.recv->deadline;
    if (!gone && !late) continue;
    const std::string arrived = " (" + std::to_string(in.bytes - in.payloadLeft) + " of its " +
                                std::to_string(in.bytes) + " bytes arrived)";
    const ErrorCode code = gone ? ErrorCode::kPeerFailure : ErrorCode::kTimeout;
    const std::string why = gone ? "rank " + std::to_string(q) +
                                       (state == RankState::kDead ? "'s process exited"
                                                                  : " destroyed its communicator") +
                                       " with its message to this rank part-way sent" + arrived
                                 : "the matching message did not finish arriving within " +
                                       std::to_string(in.recv->timeout.count()) + " ms" + arrived;
    const Op* op = in.recv         ? in.recv.get()
                   : in.unexpected ? in.unexpected->claimedBy.get()
                                   : nullptr;
    failures_.fail(code, q, op != nullptr ? opError(code, *op, false, why).detail() : why);
    return;  // failAll picks everything up on the next turn
  }
  for (auto& message : unexpected_) {
    if (message->claimedBy && now >= message->claimedBy->deadline) releaseClaim(*message);
  }
  // Sends: one that has not started can simply fail; one cut off mid-stream would leave the
  // ring unparseable, so it fails the communicator.
  for (int q = 0; q < size_; ++q) {
    auto& queue = outbound_[q];
    for (auto it = queue.begin(); it != queue.end();) {
      Op& op = **it;
      if (receiverGone(q)) {
        finish(op,
               std::make_exception_ptr(opError(ErrorCode::kPeerFailure, op, true,
                                               failures_.stateOf(q) == RankState::kDead
                                                   ? "the receiver's process exited"
                                                   : "the receiver destroyed its communicator")));
        it = queue.erase(it);
        continue;
      }
      if (now < op.deadline) {
        ++it;
        continue;
      }
      const Error error = opError(ErrorCode::kTimeout, op, true,
                                  "did not complete within " + std::to_string(op.timeout.count()) +
                                      " ms: the receiver is not draining its channel");
      if (op.done != 0) {
        failures_.fail(ErrorCode::kTimeout, q, error.detail());
        return;  // failAll picks everything up on the next turn
      }
      finish(op, std::make_exception_ptr(error));
      it = queue.erase(it);
    }
  }
}

bool P2pEngine::stillReadable(int q) {
  try {
    return links_[q]->readable();
  } catch (const Error& e) {
    // The link broke as the peer went (its process killed before its goodbye): this runs on
    // the engine's thread, or a caller's wait, with nobody above to catch it.
    linkFailed(q, e);
  } catch (const std::exception& e) {
    failures_.fail(ErrorCode::kSystem, q,
                   "reading from rank " + std::to_string(q) + " broke off: " + e.what());
  }
  return false;
}

bool P2pEngine::receiverGone(int q) const {
  // A receiver on another host that left says so on this rank's channel to it, or, where
  // that channel was made after it left (its service still takes the connection) or never,
  // on its host's control link (saidGoodbye).
  return failures_.stateOf(q) != RankState::kAlive || links_[q]->outboundEnded() ||
         failures_.saidGoodbye(q);
}

bool P2pEngine::senderGone(int q) const {
  // A sender on another host that left before it ever connected to this rank has no channel
  // to say so on: its control link did, and nothing can be in flight from it.
  return failures_.stateOf(q) != RankState::kAlive ||
         (failures_.saidGoodbye(q) && !links_[q]->inboundMade());
}

void P2pEngine::releaseClaim(Unexpected& message) {
  Op& op = *message.claimedBy;
  finish(op,
         std::make_exception_ptr(opError(ErrorCode::kTimeout, op, false,
                                         "the matching message did not finish arriving within " +
                                             std::to_string(op.timeout.count()) + " ms")));
  message.claimedBy.reset();
  // A receive posted meanwhile waits in posted_ (it passed over the claimed message); the
  // first that matches takes it now, before any later message from its sender can.
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    if (!matches((*it)->peer, (*it)->tag, message.source, message.tag)) continue;
    message.claimedBy = *it;
    posted_.erase(it);
    return;
  }
}

void P2pEngine::failAll(const Error& reason) {
  const auto failed = [&](Op& op, bool isSend) {
    finish(op, std::make_exception_ptr(opError(reason.code(), op, isSend, reason.detail())));
  };
  for (auto& queue : outbound_) {
    for (auto& op : queue) failed(*op, true);
    queue.clear();
  }
  for (auto& op : posted_) failed(*op, false);
  posted_.clear();
  for (auto& message : unexpected_) {
    if (message->claimedBy) failed(*message->claimedBy, false);
  }
  unexpected_.clear();
  for (Inbound& in : inbound_) {
    if (in.recv) failed(*in.recv, false);
    in = Inbound{};
  }
  std::vector<std::shared_ptr<Op>> sends;
  std::vector<std::shared_ptr<Op>> recvs;
  {
    std::lock_guard<std::mutex> lock(inboxMutex_);
    sends.swap(newSends_);
    recvs.swap(newRecvs_);
  }
  for (auto& op : sends) failed(*op, true);
  for (auto& op : recvs) failed(*op, false);
}

}  // namespace loom
