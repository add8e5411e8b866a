#pragma once

// The AcrossHostsContext that runs collectives: local steps on this host's segment (through
// the communicator), network steps over each pair's collective link.

#include <functional>
#include <string>

#include "algorithms/across_hosts.h"
#include "transport/failures.h"
#include "transport/message_link.h"

namespace loom {

class NetworkContext final : public AcrossHostsContext {
 public:
  /// Runs a collective among this host's ranks (local ranks and roots).
  using RunLocal = std::function<void(const CollectiveArgs&)>;
  /// This rank's collective link to communicator rank q (on another host).
  using LinkTo = std::function<MessageLink&(int q)>;
  /// How messages name rank q ("rank 3 (host 'b', 10.0.0.2:4242)").
  using Describe = std::function<std::string(int q)>;

  NetworkContext(const HostLayout& layout, ScratchArena& arena, RunLocal runLocal, LinkTo linkTo,
                 Describe describe, Failures& failures, const WaitSpec& wait)
      : AcrossHostsContext(layout, arena),
        runLocal_(std::move(runLocal)),
        linkTo_(std::move(linkTo)),
        describe_(std::move(describe)),
        failures_(failures),
        wait_(wait) {}

  void runLocal(const CollectiveArgs& args) override { runLocal_(args); }
  /// A message of the wrong size or tag is a mismatch; a broken link, a failure elsewhere or
  /// the deadline fails the communicator, and this throws its error.
  void exchange(std::span<const NetTransfer> sends, std::span<const NetTransfer> receives) override;

 private:
  [[noreturn]] void failWith(ErrorCode code, int q, const std::string& message);

  RunLocal runLocal_;
  LinkTo linkTo_;
  Describe describe_;
  Failures& failures_;
  const WaitSpec& wait_;
};

}  // namespace loom
