#pragma once

// Where the time of a collective goes, as a timeline: with LOOM_TRACE=<path prefix> set,
// every thread records named spans (a collective, a local step, a network exchange, a rail
// job, a wait), and at exit each process writes <prefix>.<pid>.json in the Chrome trace
// format (open it in https://ui.perfetto.dev or chrome://tracing). Unset, a span costs one
// predictable branch.

#include <cstdint>

namespace loom::trace {

/// True if LOOM_TRACE is set (read once).
bool enabled();

/// Records [construction, destruction) on the calling thread as `name` (a string literal),
/// with one number to tell spans apart (a sequence number, a byte count) and the CPU it
/// began on.
class Span {
 public:
  explicit Span(const char* name, uint64_t arg = 0) {
    if (enabled()) begin(name, arg);
  }
  ~Span() {
    if (name_) end();
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  void begin(const char* name, uint64_t arg);
  void end();
  const char* name_ = nullptr;
  uint64_t arg_ = 0;
  uint64_t start_ = 0;
  int cpu_ = -1;
};

/// Writes what has been recorded so far (also done at exit).
void flush();

}  // namespace loom::trace
