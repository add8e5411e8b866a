#pragma once

// The AcrossHostsContext that runs collectives: local steps on this host's segment (through
// the communicator), network steps over each pair's collective link.
//
// Threads of the communicator's share the work. A large exchange hands its sends to a send
// thread and drives its receives itself: a link's two directions are separate connections,
// and over TCP each byte costs kernel time on the thread that moves it, so one thread per
// direction moves both at once. Rail jobs (startRail) run on a rail thread, each on a
// context of its own, while the collective's thread goes on with local steps: the network
// and shared memory overlap. For the same reason a communicator may have several lanes:
// each its own collective connection to every peer, its own rail and send threads and its
// own scratch, so that several segments' rail jobs move bytes at once (one TCP connection
// moves about a core's worth).

#include <atomic>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "algorithms/across_hosts.h"
#include "transport/failures.h"
#include "transport/message_link.h"
#include "util/worker.h"

namespace loom {

/// One lane of a communicator's network work: its links and the threads and scratch of its
/// rail jobs (any thread may be null: that work is then done on the calling thread).
struct NetLane {
  /// This lane's collective link to communicator rank q (on another host).
  std::function<MessageLink&(int q)> linkTo;
  Worker* sends = nullptr;              ///< sends beside the receives of large exchanges
  Worker* rail = nullptr;               ///< runs the lane's rail jobs, in order
  ScratchArena* railScratch = nullptr;  ///< the rail jobs' scratch
};

class NetworkContext final : public AcrossHostsContext {
 public:
  /// Runs a collective among this host's ranks (local ranks and roots).
  using RunLocal = std::function<void(const CollectiveArgs&)>;
  /// How messages name rank q ("rank 3 (host 'b', 10.0.0.2:4242)").
  using Describe = std::function<std::string(int q)>;

  /// `lanes` (at least one): this thread's own network steps use lane 0's links and send
  /// thread, which its rail jobs share (they never run at the same time). `stamp`: the
  /// call's (callStamp), on every message sent and expected on every one received.
  NetworkContext(const HostLayout& layout, ScratchArena& arena, RunLocal runLocal,
                 Describe describe, Failures& failures, const WaitSpec& wait, uint64_t stamp,
                 std::vector<NetLane> lanes)
      : AcrossHostsContext(layout, arena),
        runLocal_(std::move(runLocal)),
        describe_(std::move(describe)),
        failures_(failures),
        wait_(wait),
        stamp_(stamp),
        lanes_(std::move(lanes)),
        linkTo_(lanes_.at(0).linkTo),
        sends_(lanes_[0].sends) {}
  /// Waits for rail jobs still running (a collective that failed part-way).
  ~NetworkContext() override;

  void runLocal(const CollectiveArgs& args) override;
  /// A message of the wrong size or tag is a mismatch; a broken link, a peer that left, a
  /// failure elsewhere or the deadline fails the communicator, and this throws its error.
  void exchange(std::span<const NetTransfer> sends, std::span<const NetTransfer> receives) override;
  /// Sends on the send thread beside the receiving, whatever the size.
  void forward(const NetTransfer& send, const NetTransfer& receive) override;
  /// Cut-through where a step's block reaches 256 KiB: each part of a step's receive is
  /// reduced as it lands, and the send thread passes every whole frame of it on as soon as
  /// it is there. Smaller rings go a step at a time.
  void ring(std::span<const RingStep> steps, const kernels::ReduceSpec& spec) override;
  int lanes() const override { return static_cast<int>(lanes_.size()); }
  size_t startRail(RailSteps steps, int lane) override;
  void finishRail(size_t ticket) override;

 private:
  // A job on another thread and its outcome.
  struct Job {
    std::atomic<bool> done{false};
    std::exception_ptr error;
  };
  /// Runs `fn` on `thread` (which must outlive the wait for it).
  static std::shared_ptr<Job> handOff(Worker& thread, std::function<void()> fn);
  /// Waits for `job` to finish; it always does (it watches failures and the deadline).
  static void await(const Job& job);
  // What a drive() of transfers still being produced needs (ring()): how many bytes of send
  // i exist yet; receive i's bytes from byte `at` on where they lie in the link's memory, to
  // take from there (all of `view`; where the link keeps none, they are read into the
  // receive's memory instead); what to do once receive i has `landed` bytes; and a flag the
  // other direction's thread raises when it gave up.
  struct Streaming {
    std::function<uint64_t(size_t send)> ready;
    std::function<void(size_t receive, size_t at, std::span<const uint8_t> view)> take;
    std::function<void(size_t receive, size_t landed)> landed;
    std::atomic<bool>* abandoned = nullptr;
  };
  /// Hands the sends to the send thread and drives the receives on this one.
  void sendBeside(std::span<const NetTransfer> sends, std::span<const NetTransfer> receives,
                  const Streaming* streaming = nullptr);
  /// Moves the transfers on this thread until all are done (one direction may be empty).
  void drive(std::span<const NetTransfer> sends, std::span<const NetTransfer> receives,
             const Streaming* streaming = nullptr);
  [[noreturn]] void failWith(ErrorCode code, int q, const std::string& message);

  RunLocal runLocal_;
  Describe describe_;
  Failures& failures_;
  const WaitSpec& wait_;
  const uint64_t stamp_;
  const std::vector<NetLane> lanes_;
  const std::function<MessageLink&(int q)>& linkTo_;  // lane 0's
  Worker* const sends_;                               // lane 0's
  std::vector<std::shared_ptr<Job>> railJobs_;        // by ticket
};

}  // namespace loom
