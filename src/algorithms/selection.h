#pragma once

// Which algorithm runs a collective, by message size. Each operation with a choice has an
// ordered list of (algorithm, largest size in bytes); the first entry whose bound is at
// least the message size wins. LOOM_ALGO overrides entries, for example
//   LOOM_ALGO="all_reduce:one_shot:64K,two_shot:inf;reduce:two_shot:inf"
// Every rank must use the same table: each rank's choice travels in its operation
// descriptor, so a difference is reported as a mismatch rather than a hang.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

/// The algorithms with alternatives. One-shot: every rank copies its whole input in and
/// reduces all slots itself (one synchronisation; best when small). Two-shot: reduce-scatter
/// then all-gather by chunk, each rank reducing 1/size of the data (bandwidth-optimal).
/// Lent: all_gather and reduce_scatter of at least LOOM_LEND_BYTES read every rank's input in
/// place when all ranks lent it (memory from the lending pool), else stage it as usual.
enum class Algorithm : uint8_t { kOneShot = 1, kTwoShot = 2, kLent = 3 };

/// "one_shot", "two_shot", "lent".
std::string_view algorithmName(Algorithm algorithm);

/// Size-based selection for the operations that have a choice.
class SelectionTable {
 public:
  struct Entry {
    Algorithm algorithm;
    uint64_t maxBytes;  ///< UINT64_MAX = no bound
  };

  /// Defaults tuned on the hosts in docs/PERFORMANCE.md, then LOOM_ALGO applied.
  static SelectionTable fromEnvironment();
  /// Parses a LOOM_ALGO string over the defaults; throws Error(kInvalidArgument) saying
  /// what is wrong.
  static SelectionTable parse(const std::string& spec);

  Algorithm allReduce(size_t bytes) const { return pick(allReduce_, bytes); }
  Algorithm reduce(size_t bytes) const { return pick(reduce_, bytes); }

 private:
  static Algorithm pick(const std::vector<Entry>& entries, size_t bytes);
  // One-shot reads every rank's whole input from another core's cache; two-shot reads a
  // 1/P slice but synchronises twice. On 2 to 16 ranks two-shot wins from 2-8 KiB
  // (docs/PERFORMANCE.md); 4 KiB splits the difference.
  std::vector<Entry> allReduce_{{Algorithm::kOneShot, 4 << 10}, {Algorithm::kTwoShot, UINT64_MAX}};
  std::vector<Entry> reduce_{{Algorithm::kOneShot, 4 << 10}, {Algorithm::kTwoShot, UINT64_MAX}};
};

}  // namespace loom
