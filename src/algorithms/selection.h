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
/// Peer read: an all_to_all from LOOM_PEER_READ_BYTES to LOOM_PEER_READ_MAX_BYTES copies straight
/// out of peers' memory (transport/shm/peer_reads.h) where every rank can, else stages.
enum class Algorithm : uint8_t { kOneShot = 1, kTwoShot = 2, kLent = 3, kPeerRead = 4 };

/// "one_shot", "two_shot", "lent", "peer_read".
std::string_view algorithmName(Algorithm algorithm);

/// Size-based selection for the operations that have a choice.
class SelectionTable {
 public:
  struct Entry {
    Algorithm algorithm;
    uint64_t maxBytes;  ///< UINT64_MAX = no bound
  };

  /// The defaults for ranks of the 32-core host's measurements (one-shot up to 4 KiB).
  SelectionTable() = default;
  /// The defaults for `localRanks` ranks sharing a host (where one-shot stops paying
  /// depends on how many inputs each rank reads whole; docs/PERFORMANCE.md).
  explicit SelectionTable(int localRanks);

  /// Defaults for `localRanks` ranks on this host, then LOOM_ALGO applied.
  static SelectionTable fromEnvironment(int localRanks);
  /// Parses a LOOM_ALGO string over `defaults` (or the default-constructed table); throws
  /// Error(kInvalidArgument) saying what is wrong.
  static SelectionTable parse(const std::string& spec, SelectionTable defaults);
  static SelectionTable parse(const std::string& spec);

  Algorithm allReduce(size_t bytes) const { return pick(allReduce_, bytes); }
  Algorithm reduce(size_t bytes) const { return pick(reduce_, bytes); }

 private:
  static Algorithm pick(const std::vector<Entry>& entries, size_t bytes);
  // One-shot reads every rank's whole input from another core's cache; two-shot reads a
  // 1/P slice but synchronises twice. On the 32-core host two-shot won from 2-8 KiB on 2 to
  // 16 ranks, 4 KiB splitting the difference; on the 16-core host from 2 KiB at 4 ranks and
  // from 512 B (the smallest size measured) at 8 and 16 (docs/PERFORMANCE.md, "Where
  // one-shot stops"), so more ranks switch sooner (the constructor taking localRanks).
  std::vector<Entry> allReduce_{{Algorithm::kOneShot, 4 << 10}, {Algorithm::kTwoShot, UINT64_MAX}};
  std::vector<Entry> reduce_{{Algorithm::kOneShot, 4 << 10}, {Algorithm::kTwoShot, UINT64_MAX}};
};

}  // namespace loom
