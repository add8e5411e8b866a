#pragma once

// The anonymous shared memory both communicator segments and tensor-store regions live in.

#include <cstddef>
#include <string>
#include <string_view>

#include "util/posix.h"

namespace loom::shm {

/// A new memfd of `bytes` bytes named `name` (as /proc/<pid>/maps shows it): never a file in
/// /dev/shm, so nothing outlives the processes holding it; owner-only (0600), so another
/// user cannot open it through /proc; sealed against resizing, so no holder can shrink it
/// under another's mapping (SIGBUS). Failures throw Error(kSystem) for operation `op`,
/// naming `what` ("the shared segment", ...).
posix::Fd sealedMemfd(const char* name, size_t bytes, std::string_view op, const std::string& what);

/// True if `fd` carries the seals sealedMemfd adds (check before mapping a received one).
bool isSealed(int fd);

}  // namespace loom::shm
