#pragma once

// Tag-matched send/recv between the ranks of one communicator, beside (not in) the
// collective queue, so a send issued before a collective cannot deadlock it.
//
// The engine owns matching, deadlines and requests; the bytes travel over one MessageLink
// per peer (shared-memory rings within a host; see transport/message_link.h). A send
// completes once the link has taken all of it, so small sends complete at once and large
// ones stream as the receiver drains. The engine thread drains its inbound links
// continuously: into the matching posted receive if there is one, else into a heap buffer
// (an "unexpected" message) that a later receive takes. Matching follows MPI: messages from
// one sender with one tag are received in send order. The engine thread starts with the
// communicator's first send or receive and sleeps on the rank's doorbell futex when idle.
//
// The caller's thread moves its small operations on too (up to kCallerDrivenBytes): a new
// one gets one turn of the engine at once (a small send completes before `send` returns),
// and a thread waiting on one takes turns while it spins (OpState::progress). Whoever holds
// the gate's mutex takes the turn; operations it ends complete after the mutex is released,
// so a completion callback may queue the next send. Completion callbacks run on the
// engine's thread too; one that waits there drives the whole engine itself, deadlines
// included (detail::waitsMustDrive), since the thread that would is the one waiting.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/op_state.h"
#include "loom/request.h"
#include "transport/failures.h"
#include "transport/message_link.h"
#include "transport/shm/shm_comm.h"

namespace loom {

class P2pEngine {
 public:
  using Clock = std::chrono::steady_clock;
  /// The largest send or receive its caller's thread drives (larger: the engine's thread).
  static constexpr size_t kCallerDrivenBytes = size_t{32} << 10;

  /// The engine of communicator rank `rank` of `links.size()`: `links[q]` carries messages
  /// to and from rank q (the engine's own rank included); `shm` gives this rank's doorbell,
  /// `failures` the communicator's failure domain; `sink` (may be null) is told of every
  /// failed operation.
  P2pEngine(int rank, shm::ShmComm& shm, Failures& failures,
            std::vector<std::unique_ptr<MessageLink>> links, detail::FailureSink* sink);
  /// Stops the thread; operations still pending fail with kAborted.
  ~P2pEngine();
  /// Blocks until every send issued so far has ended (each by its deadline at the latest),
  /// or for `atMost`. Not on the engine's own thread (it would wait for itself).
  void waitForSends(std::chrono::milliseconds atMost);
  /// Whether the calling thread is this engine's own (a completion callback runs there).
  bool onItsThread() const { return std::this_thread::get_id() == thread_.get_id(); }
  P2pEngine(const P2pEngine&) = delete;
  P2pEngine& operator=(const P2pEngine&) = delete;

  /// Queues a send of `bytes` bytes to `peer`; `flightId` is its flight-record entry or 0.
  Request send(const void* data, size_t bytes, int peer, int tag, std::chrono::milliseconds timeout,
               uint64_t flightId);
  /// Queues a receive of exactly `bytes` bytes from `peer` (or kAnySource).
  Request recv(void* data, size_t bytes, int peer, int tag, std::chrono::milliseconds timeout,
               uint64_t flightId);

 private:
  struct Op {
    std::shared_ptr<detail::OpState> state;
    uint8_t* data = nullptr;  ///< recv destination, or send source (cast)
    size_t bytes = 0;
    int peer = 0;
    int tag = 0;
    Clock::time_point deadline;
    std::chrono::milliseconds timeout{0};
    uint64_t done = 0;  ///< sends: what the link has taken so far (see MessageLink::write)
  };
  struct Unexpected {  // a message that arrived before its receive
    int source = 0;
    int tag = 0;
    std::vector<uint8_t> data;
    size_t received = 0;
    std::shared_ptr<Op> claimedBy;  ///< a receive waiting for the rest of it
  };
  struct Inbound {  // the message arriving from one source, if any
    bool active = false;
    uint64_t bytes = 0;
    uint64_t payloadLeft = 0;
    uint8_t* target = nullptr;               ///< where the payload goes; nullptr discards it
    std::shared_ptr<Op> recv;                ///< the receive being filled directly
    std::shared_ptr<Unexpected> unexpected;  ///< or the buffer being filled
  };

  /// Who may take a turn of the engine: the engine's thread, or a caller's thread (while
  /// posting or waiting) holding `mutex`. `engine` is cleared when the engine goes, so a
  /// waiter holding an operation of a gone engine finds nothing to drive.
  struct Gate {
    std::mutex mutex;
    P2pEngine* engine = nullptr;  ///< guarded by mutex
    /// Callers' threads marking operations of `engine` ended now (guarded by mutex): a
    /// failed one tells the communicator (its FailureSink), so the engine, which goes before
    /// the communicator, waits for them (`marked`).
    int marking = 0;
    std::condition_variable marked;
    /// One turn on the caller's thread if no other thread is in one; true if it did anything.
    /// With `anyThread` false only on the engine's own thread (for the operations that
    /// otherwise only that thread drives); a turn there also ends what is past its deadline,
    /// as `expire` asks elsewhere (a waiter that slept: the engine's thread may be in a
    /// callback, where nothing else would end them).
    bool progress(bool anyThread, bool expire);
  };
  struct Finished {  // an operation ended in a turn, completed once the gate is released
    std::shared_ptr<detail::OpState> state;
    std::exception_ptr error;
  };

  /// Queues a new send or receive (`queue`: newSends_ or newRecvs_), takes a turn for it here
  /// and wakes the engine if that did not end it.
  Request post(std::vector<std::shared_ptr<Op>>& queue, void* data, size_t bytes, int peer, int tag,
               std::chrono::milliseconds timeout, uint64_t flightId);
  void run();
  /// One pass over new operations, sends and receives (the gate held); true if it did anything.
  bool turn();
  /// Completes what the turns ended (the gate released): marks every one ended, then runs
  /// their callbacks.
  static void complete(std::vector<Finished>& finished);
  /// complete()'s first half: marks every one ended; returns their callbacks.
  static std::vector<detail::OpState::Callbacks> markEnded(std::vector<Finished>& finished);
  /// complete()'s second half.
  static void runCallbacks(std::vector<Finished>& finished,
                           std::vector<detail::OpState::Callbacks>& callbacks);
  /// Waits for a doorbell ring after `seen` (spinning first if `spin`), or a slice if links
  /// must be polled or operations' `deadlines` watched; true if a ring came.
  bool sleepUntilRung(uint32_t seen, bool spin, bool deadlines);
  /// Whether any send or receive is pending (something whose deadline must be watched).
  bool hasDeadlines() const;
  bool acceptNewOps();
  bool progressSends();
  bool progressReceives();
  /// Records the failure of the link with rank q: the peer lost if it broke there, else
  /// this rank's own failure.
  void linkFailed(int q, const Error& e);
  /// Moves what has arrived from `source` into receives or unexpected buffers; true if any.
  bool drain(int source);
  /// Whether a send issued has not ended yet (the gate held).
  bool sendsPending();
  void startMessage(int source, Inbound& in, const Envelope& envelope);
  void finishMessage(int source, Inbound& in);
  void postReceive(const std::shared_ptr<Op>& op);
  void deliver(Unexpected& message, Op& op);
  void expire(Clock::time_point now);
  /// Ends the receive of `message` that waited for the rest of it at its deadline, and hands
  /// the message to the next posted receive it matches (messages keep their order).
  void releaseClaim(Unexpected& message);
  /// Whether bytes from rank q are waiting on its link, for the checks that end waits on a
  /// peer that left: a link that broke meanwhile fails the communicator (as drain() would)
  /// and reads as empty, rather than throw out of expire().
  bool stillReadable(int q);
  /// Whether sends to rank q can never be taken: it died or left (its state), or it left and
  /// said so on this rank's channel to it or on its host's control link.
  bool receiverGone(int q) const;
  /// Whether no message can come from rank q any more: it died or left (its state), or it
  /// left, saying so on its host's control link, without ever connecting to this rank.
  bool senderGone(int q) const;
  /// Fails every operation with `reason`'s code and detail, each error naming its operation.
  void failAll(const Error& reason);
  void finish(Op& op, std::exception_ptr error);
  Error opError(ErrorCode code, const Op& op, bool isSend, const std::string& what) const;
  /// The failure of a receive whose matching message (`bytes` from `source`) does not fit.
  std::exception_ptr tooLarge(const Op& op, int source, uint64_t bytes) const;

  shm::ShmComm& shm_;
  Failures& failures_;
  detail::FailureSink* sink_;
  const int rank_;
  const int size_;
  bool polls_ = false;  // some link must be polled (see MessageLink::polled)

  std::mutex inboxMutex_;
  std::vector<std::shared_ptr<Op>> newSends_;  // guarded by inboxMutex_
  std::vector<std::shared_ptr<Op>> newRecvs_;  // guarded by inboxMutex_
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> nextSeq_{0};
  const std::shared_ptr<Gate> gate_;

  // The engine's state, guarded by gate_->mutex (held by whichever thread takes a turn).
  std::vector<Finished> finished_;                         // ended in the current turn
  std::vector<std::deque<std::shared_ptr<Op>>> outbound_;  // per destination, FIFO
  std::vector<std::unique_ptr<MessageLink>> links_;        // per peer
  std::vector<Inbound> inbound_;
  std::list<std::shared_ptr<Op>> posted_;              // receives without a message yet
  std::list<std::shared_ptr<Unexpected>> unexpected_;  // messages without a receive yet

  std::thread thread_;
};

}  // namespace loom
