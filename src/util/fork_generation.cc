// The fork generation: a counter the child's fork handler moves on.

#include "util/fork_generation.h"

#include <pthread.h>

#include <atomic>

namespace loom::forks {

namespace {

std::atomic<uint64_t> gGeneration{0};

void bumpInTheChild() {
  gGeneration.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

uint64_t generation() {
  // Registered on first use, which comes before any fork that matters: a value read before
  // the handler existed is that of the process that read it.
  static const bool registered = [] {
    ::pthread_atfork(nullptr, nullptr, &bumpInTheChild);
    return true;
  }();
  (void)registered;
  return gGeneration.load(std::memory_order_relaxed);
}

}  // namespace loom::forks
