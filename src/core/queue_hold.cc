// Calls held in the queue by a completion callback that does not return (util/worker.h):
// what the communicator's failure and the calls given up say, apart from the rest of
// CommState.

#include <string>

#include "core/comm_state.h"

namespace loom::detail {

void CommState::queueHeld(const Worker::Hold& hold) {
  const std::string callback =
      hold.tag == 0 ? std::string("a completion callback")
                    : "a completion callback of its call #" + std::to_string(hold.tag);
  std::string reason =
      "rank " + std::to_string(rank_) + "'s calls waited " + std::to_string(hold.waited.count()) +
      " ms (the timeout) behind " + callback +
      " that had not returned: a callback runs on the communicator's worker thread, ahead of "
      "the calls queued after it, and must not wait for a later call of the communicator (a "
      "future taken before it ran, an event set after such a call) nor run longer than the "
      "timeout; wait from another thread or chain another callback, and make a new "
      "communicator";
  {
    std::lock_guard<std::mutex> lock(heldMutex_);
    heldReason_ = reason;
  }
  // Recorded for every rank unless a failure came first (a peer's timeout, waiting for
  // this rank in the very call held here): the calls given up then say both.
  failures_->fail(ErrorCode::kTimeout, rank_, reason);
}

std::exception_ptr CommState::heldError(std::string_view op, uint64_t seq) {
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(heldMutex_);
    reason = heldReason_;
  }
  const Error recorded = failures_->failureError(op);
  if (reason.empty()) return std::make_exception_ptr(recorded);  // no hold of this rank's
  std::string detail = std::string(op) + " #" + std::to_string(seq) + " never started: " + reason;
  // The shared record holds a message's start only: that is what tells whose it is.
  if (recorded.detail().find(reason.substr(0, 80)) == std::string::npos) {
    detail += "; the communicator had failed already: " + recorded.detail();
  }
  return std::make_exception_ptr(Error(ErrorCode::kTimeout, op, rank_, detail));
}

}  // namespace loom::detail
