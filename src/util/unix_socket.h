#pragma once

// Unix stream sockets in the abstract namespace, and passing a file descriptor along with
// a message (SCM_RIGHTS).

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <string>

#include "util/posix.h"

namespace loom::unix_socket {

/// Listens on the abstract name `name` (no leading NUL; nothing is created on disk).
posix::Fd listenAbstract(const std::string& name);

/// Connects to the abstract name `name`; an invalid Fd if nobody listens there.
posix::Fd connectAbstract(const std::string& name);

/// The uid and pid of the process at the other end (SO_PEERCRED); false on failure.
bool peerCredentials(int socket, unsigned* uid, int* pid);

/// Sends `n` bytes and, if fdToSend >= 0, that descriptor with them. False on failure.
bool sendWithFd(int socket, const void* data, size_t n, int fdToSend);

/// One recvmsg of up to `n` bytes (retried on EINTR); a descriptor sent with them lands in
/// `received`. Returns the byte count, 0 at end of stream, or -1 with errno set.
ssize_t recvSome(int socket, void* data, size_t n, posix::Fd* received);

/// Receives exactly `n` bytes, waiting until `deadline`; a descriptor sent with them lands
/// in `received` (left invalid if none came). False on timeout, error or end of stream.
bool recvWithFd(int socket, void* data, size_t n, posix::Fd* received,
                std::chrono::steady_clock::time_point deadline);

/// Whether the other end of `socket` has closed it (or it failed), without waiting or
/// consuming anything; for a peer that is to send nothing until it is answered.
bool hungUp(int socket);

}  // namespace loom::unix_socket
