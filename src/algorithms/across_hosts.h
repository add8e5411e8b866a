#pragma once

// Collectives over ranks on several hosts: shared memory within each host (the ordinary
// algorithms over this host's segment, with local ranks and roots), the network between
// hosts. Each collective is a composition (hierarchical.cc) of local steps and inter-host
// steps among the ranks of one local index on every host, a "rail" (rail.h), so every
// local rank of a host that has work drives its own share of the network traffic.
//
// Algorithms reach memory, the host's segment and the network only through the
// AcrossHostsContext they are given. Three contexts implement it: the network one that runs
// them (network_context.h), a recorder that only writes down each rank's steps
// (schedule.h: the simulation that checks the schedules up to thousands of ranks and feeds
// the cost model of docs/SCALING.md), and an in-memory one in the unit tests that runs many
// hosts as threads. So an algorithm must never touch a buffer itself: every copy,
// reduction and zeroing goes through the context, and the recorder's buffers are addresses
// that are never read.

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <span>
#include <vector>

#include "algorithms/collective.h"
#include "kernels/reduce.h"

namespace loom {

/// Where the ranks of a communicator that spans hosts run, as one rank sees it.
struct HostLayout {
  int rank = 0;
  int size = 0;
  int host = 0;                           ///< this rank's host
  int localIndex = 0;                     ///< its index among its host's ranks
  int rails = 1;                          ///< the fewest ranks any host has
  std::vector<std::vector<int>> ranksOn;  ///< each host's ranks, ascending
  int hosts() const { return static_cast<int>(ranksOn.size()); }
  int localSize() const { return static_cast<int>(ranksOn[host].size()); }

  /// The layout of `ranksOn` (hosts numbered in their order) as rank `rank` sees it.
  static HostLayout of(std::vector<std::vector<int>> ranksOn, int rank);
};

/// One message of a network exchange: `bytes` at `data` to or from `peer` (a communicator
/// rank on another host). Both ends name the same `tag`; a message that arrives with
/// another tag or size is a mismatch.
struct NetTransfer {
  int peer = 0;
  void* data = nullptr;
  size_t bytes = 0;
  int tag = 0;
};

/// One step of a ring: `send` goes to the next member while `receive` arrives from the
/// previous one; then, where `into` is set, `into` = reduce(into, receive) (elementwise, so
/// reducing it in parts gives the same bits as reducing it whole).
struct RingStep {
  NetTransfer send;
  NetTransfer receive;
  void* into = nullptr;
};

/// Scratch buffers kept from one collective to the next: allocating a large buffer and
/// faulting its pages in anew for every call would cost more than many a network step.
class ScratchArena {
 public:
  /// The next unused buffer, of at least `bytes`.
  uint8_t* take(size_t bytes);
  /// Every buffer is unused again (at the start of a collective).
  void reset() { used_ = 0; }

 private:
  std::vector<std::vector<uint8_t>> buffers_;
  size_t used_ = 0;
};

/// What a collective across hosts uses of its communicator and of memory.
class AcrossHostsContext {
 public:
  /// Scratch comes from `arena`, which is reset here.
  AcrossHostsContext(const HostLayout& layout, ScratchArena& arena)
      : layout_(layout), arena_(arena) {
    arena_.reset();
  }
  virtual ~AcrossHostsContext() = default;
  AcrossHostsContext(const AcrossHostsContext&) = delete;
  AcrossHostsContext& operator=(const AcrossHostsContext&) = delete;

  const HostLayout& layout() const { return layout_; }

  /// Runs a collective among this host's ranks (ranks, roots and per-rank lists are local:
  /// index i is ranksOn[host][i]). Every rank of the host runs the same local steps in the
  /// same order.
  virtual void runLocal(const CollectiveArgs& args) = 0;
  /// Sends and receives every transfer, all progressing together, and returns once all
  /// sends have left and all receives have arrived. Several transfers with one peer travel
  /// in the order given, in each direction. Failures throw the communicator's error.
  virtual void exchange(std::span<const NetTransfer> sends,
                        std::span<const NetTransfer> receives) = 0;
  /// exchange() of one step of a pipeline that receives from one peer while passing what it
  /// already has on to another (a chain): the two directions never wait for each other, so
  /// a context that can should send beside the receiving at any size. Default: exchange().
  virtual void forward(const NetTransfer& send, const NetTransfer& receive);
  /// Runs the steps of a ring (rail.cc), each an exchange with the same two neighbours
  /// followed, where `into` is set, by reducing what arrived into it (`into` first). Step
  /// s + 1 sends exactly the bytes step s produced (its `into`, or its receive where none),
  /// so a context that can passes each part on as soon as it has arrived and been reduced,
  /// rather than waiting for whole blocks (cut-through). Default: one step at a time.
  virtual void ring(std::span<const RingStep> steps, const kernels::ReduceSpec& spec);

  /// kernels::reduce of `srcs` (in that order) into `dst`.
  virtual void reduce(void* dst, std::span<const void* const> srcs, size_t count,
                      const kernels::ReduceSpec& spec);
  /// Copies `bytes` (the ranges may be equal, never partly overlap).
  virtual void copy(void* dst, const void* src, size_t bytes);
  /// Sets `bytes` at `dst` to zero.
  virtual void zero(void* dst, size_t bytes);
  /// Converts `count` integers of type `from` at `src` to type `to` at `dst` (C++
  /// conversions: widening is exact, narrowing wraps), or float16 to float32 and back
  /// (exact; back rounds to nearest even).
  virtual void convert(void* dst, DataType to, const void* src, DataType from, size_t count);
  /// `bytes` of scratch memory that stays valid until the collective ends.
  virtual uint8_t* scratch(size_t bytes);

  /// A rail's part of a collective (exchanges, reductions, copies; never runLocal), run on
  /// a context of its own.
  using RailSteps = std::function<void(AcrossHostsContext& ctx)>;
  /// How many rail jobs may run side by side: each lane has connections and threads of its
  /// own (network_context.h says why). The same on every rank of a communicator, since it
  /// sets the order of the local steps of pipelined collectives. This default: one.
  virtual int lanes() const { return 1; }
  /// Starts `steps` on lane `lane` (0 to lanes() - 1) and returns a ticket at once. Where the
  /// context can, they run on another thread while this one goes on with local steps (the
  /// network context's rail threads), so a collective can overlap the network with shared
  /// memory; the jobs of one lane run one at a time, in the order started, and both ends of
  /// a connection put a job on the same lane. This default runs them here and now.
  virtual size_t startRail(RailSteps steps, int lane);
  /// Waits for the job of `ticket` and rethrows its failure.
  virtual void finishRail(size_t ticket);

 private:
  const HostLayout& layout_;
  ScratchArena& arena_;
  std::vector<std::exception_ptr> ranHere_;  // the outcome of each job the default ran
};

/// Runs the collective `args` (as the caller passed it: communicator ranks, whole lists).
void runAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args);

}  // namespace loom
