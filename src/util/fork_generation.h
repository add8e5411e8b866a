#pragma once

// Telling a forked process from the one it was forked from, without a system call: a number
// that a fork handler changes in the child.

#include <cstdint>

namespace loom::forks {

/// The same all through one process; different in a process forked from it (read it once
/// before the fork, as loom does when it issues an operation).
uint64_t generation();

}  // namespace loom::forks
