#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>

namespace loom {

namespace detail {
struct OpState;
}

/// A handle to an operation in flight. Copies share the operation. A default-constructed
/// Request is already complete.
class Request {
 public:
  Request() = default;
  explicit Request(std::shared_ptr<detail::OpState> state) : state_(std::move(state)) {}

  /// True once the operation has finished, successfully or not. Never blocks.
  bool test() const;
  /// Blocks until the operation finishes; rethrows its Error if it failed.
  void wait() const;
  /// Waits at most `timeout`: true if it finished (rethrowing its Error if it failed),
  /// false if it is still running. The operation itself keeps its own deadline.
  bool waitFor(std::chrono::milliseconds timeout) const;
  /// The failure, or nullptr while running or after success.
  std::exception_ptr error() const;
  /// Position of the operation in its communicator's issue order: among its collectives, or
  /// among its sends and receives (to and from any peer); 0 for a default-constructed request.
  uint64_t sequence() const;
  /// For a receive: the rank the message came from (useful with recvAny). -1 otherwise.
  int sourceRank() const;
  /// When the operation began to run: a collective when its thread took it up (after the
  /// communicator's earlier collectives), a send or receive when it was issued; the clock's
  /// epoch for a default-constructed request. Read it once test() is true.
  std::chrono::steady_clock::time_point startedAt() const;
  /// Asks a send or receive that has not begun to move bytes to end at once with
  /// Error(kAborted) (torch's Work.abort()); one under way finishes, and a collective is not
  /// affected (abort its communicator to end those). Returns at once; test() tells when it
  /// has ended, and how.
  void cancel() const;
  /// Runs `callback` with the failure (nullptr on success) once the operation finishes: on
  /// the thread that finishes it, or right away on this thread if it has finished already
  /// (then what it throws reaches this caller). One that throws on another thread is
  /// reported on stderr and its exception dropped; the callbacks after it still run.
  void onComplete(std::function<void(std::exception_ptr)> callback) const;

 private:
  std::shared_ptr<detail::OpState> state_;
};

}  // namespace loom
