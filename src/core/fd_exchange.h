#pragma once

// Every rank of one host hands a file descriptor to every other (device memory exported by
// each rank, for instance) through the host's leader, over its process service socket, with
// the same uid and job-secret checks as the segment hand-off:
//   member -> leader: Hello;  leader -> member: Welcome
//   member -> leader: its offer, a Welcome: status 0 with its descriptor (SCM_RIGHTS) and a
//                     short note in the text, or a refusal saying why it has none
//   leader -> member: every rank's descriptor and note, in local rank order, one Welcome each; or,
//                     if any rank refused or was lost before it offered, one Welcome
//                     saying so
// A rank that cannot make its descriptor still takes part, so every rank of the host fails
// at once with its reason instead of waiting for it until the deadline.

#include <chrono>
#include <string>
#include <vector>

#include "core/handshake.h"
#include "loom/error.h"
#include "util/comm_id.h"
#include "util/posix.h"

namespace loom::detail {

/// What one exchange needs to know.
struct FdExchange {
  CommId id;                  ///< unique to this exchange (derived from the communicator's)
  handshake::Secret secret;   ///< the job's
  int localRank = 0;          ///< this rank's index on the host; 0 is the leader
  int localSize = 1;          ///< ranks on the host
  std::string leaderAddress;  ///< the leader's process service socket
  std::string op;             ///< for messages
  int rank = -1;              ///< communicator rank, for messages
};

/// Thrown on every rank but the refusing ones when a rank refused: then no rank holds
/// another's descriptor.
class ExchangeRefused : public Error {
 public:
  using Error::Error;
};

/// One local rank's offer as every rank receives it.
struct FdOffer {
  posix::Fd fd;      ///< its descriptor
  std::string note;  ///< what it said about it (a few words every rank must agree on)
};

/// The longest note an offer carries (a Welcome's text holds 199 characters).
inline constexpr size_t kMaxFdNote = 192;

/// Returns every local rank's offer, by local index (this rank's holds a copy of `mine` and
/// `note`, at most kMaxFdNote characters). Throws ExchangeRefused (kPeerFailure) naming a
/// rank that refused and why, Error(kPeerFailure) naming a rank that disconnected, and
/// Error(kTimeout) at `deadline`.
std::vector<FdOffer> exchangeFds(const FdExchange& exchange, int mine, const std::string& note,
                                 std::chrono::steady_clock::time_point deadline);

/// This rank's part in an exchange when it has no descriptor to offer: tells the host's
/// other ranks `why` (their exchangeFds throws it, naming this rank) and returns once they
/// know, or at `deadline`. Never throws: its caller reports its own error.
void refuseFds(const FdExchange& exchange, const std::string& why,
               std::chrono::steady_clock::time_point deadline) noexcept;

}  // namespace loom::detail
