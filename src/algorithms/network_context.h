#pragma once

// The AcrossHostsContext that runs collectives: local steps on this host's segment (through
// the communicator), network steps over each pair's collective link.
//
// Two threads of the communicator's may share the work (Offload). A large exchange hands its
// sends to the send thread and drives its receives itself: a link's two directions are
// separate connections, and over TCP each byte costs kernel time on the thread that moves
// it, so one thread per direction moves both at once. Rail jobs (startRail) run on the rail
// thread, each on a context of its own, while the collective's thread goes on with local
// steps: the network and shared memory overlap.

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

/// The communicator's threads a NetworkContext may hand work to, and the rail jobs' scratch
/// (any may be null: that work is then done on the calling thread).
struct NetOffload {
  Worker* sends = nullptr;
  Worker* rail = nullptr;
  ScratchArena* railScratch = nullptr;
};

class NetworkContext final : public AcrossHostsContext {
 public:
  /// Runs a collective among this host's ranks (local ranks and roots).
  using RunLocal = std::function<void(const CollectiveArgs&)>;
  /// This rank's collective link to communicator rank q (on another host).
  using LinkTo = std::function<MessageLink&(int q)>;
  /// How messages name rank q ("rank 3 (host 'b', 10.0.0.2:4242)").
  using Describe = std::function<std::string(int q)>;

  NetworkContext(const HostLayout& layout, ScratchArena& arena, RunLocal runLocal, LinkTo linkTo,
                 Describe describe, Failures& failures, const WaitSpec& wait,
                 NetOffload offload = {})
      : AcrossHostsContext(layout, arena),
        runLocal_(std::move(runLocal)),
        linkTo_(std::move(linkTo)),
        describe_(std::move(describe)),
        failures_(failures),
        wait_(wait),
        offload_(offload) {}
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
  size_t startRail(RailSteps steps) override;
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
  LinkTo linkTo_;
  Describe describe_;
  Failures& failures_;
  const WaitSpec& wait_;
  NetOffload offload_;
  std::vector<std::shared_ptr<Job>> railJobs_;
};

}  // namespace loom
