#pragma once

// Collectives over ranks on several hosts. Shared memory within each host (the ordinary
// algorithms over this host's segment, with local ranks and roots), the network between
// hosts over each pair's collective link (channel 1, beside send/recv's channel 0).
//
// all_reduce is hierarchical and spreads the network traffic over every local rank: the
// buffer is cut into R slices, R being the fewest ranks any host has; slice s is reduced
// within each host to the rank of local index s, which ring-all-reduces it with the ranks of
// local index s on the other hosts (its "rail"), and each host broadcasts the slices back.
// So R ranks per host drive the network at once, each with 1/R of the bytes. Small buffers
// use one rail (fewer local steps). all_to_all exchanges blocks directly, over the segment
// with ranks of this host and over the network with the others. The other collectives are
// derived from all_reduce for now (a bitwise OR of disjoint contributions moves bytes
// exactly), at about twice the bytes a dedicated algorithm would move.

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "algorithms/collective.h"
#include "transport/failures.h"
#include "transport/message_link.h"

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
};

/// One block of a network exchange: `bytes` at `data` to or from `peer` (a communicator
/// rank on another host), as one message tagged `tag`.
struct NetTransfer {
  int peer = 0;
  void* data = nullptr;
  size_t bytes = 0;
  int tag = 0;
};

/// What a collective across hosts uses of its communicator.
class AcrossHostsContext {
 public:
  /// Runs a collective among this host's ranks (ranks and roots are local indices).
  using RunLocal = std::function<void(const CollectiveArgs&)>;
  /// This rank's collective link to communicator rank q (on another host).
  using LinkTo = std::function<MessageLink&(int q)>;
  /// How messages name rank q ("rank 3 (host 'b', 10.0.0.2:4242)").
  using Describe = std::function<std::string(int q)>;

  AcrossHostsContext(const HostLayout& layout, RunLocal runLocal, LinkTo linkTo, Describe describe,
                     Failures& failures, const WaitSpec& wait)
      : layout_(layout),
        runLocal_(std::move(runLocal)),
        linkTo_(std::move(linkTo)),
        describe_(std::move(describe)),
        failures_(failures),
        wait_(wait) {}

  const HostLayout& layout() const { return layout_; }
  void runLocal(const CollectiveArgs& args) const { runLocal_(args); }
  /// Sends and receives every transfer, all progressing together, and returns once the
  /// sends have left this process and the receives have arrived. A message of the wrong
  /// size or tag is a mismatch; a broken link, a failure elsewhere or the deadline fails
  /// the communicator, and this throws.
  void exchange(std::span<const NetTransfer> sends, std::span<const NetTransfer> receives);

 private:
  [[noreturn]] void failWith(ErrorCode code, int q, const std::string& message);

  const HostLayout& layout_;
  RunLocal runLocal_;
  LinkTo linkTo_;
  Describe describe_;
  Failures& failures_;
  const WaitSpec& wait_;
};

/// Runs the collective `args` (as the caller passed it: communicator ranks, whole lists).
void runAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args);

}  // namespace loom
