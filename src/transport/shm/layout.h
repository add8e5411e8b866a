#pragma once

// The layout of one communicator's shared-memory segment. Every rank maps the same memfd;
// all offsets below are from the start of the mapping.
//
//   header            one page: identity, sizes, and the failure record
//   rank lines        one cache line per rank: its phase counter (see ShmComm)
//   doorbells         one cache line per rank: wakes its point-to-point engine
//   descriptors       per rank, per half: the operation that rank started there
//   signatures        per rank, per half: the caller's text for that operation (desync debug)
//   lent buffers      per rank, per half: where that operation's input lies if the rank lends
//                     it (memory from the lending pool, which peers map and read in place)
//   goodbyes          one byte per rank of the communicator: set once that rank, on another
//                     host, said goodbye on its control link (heard by a rail rank here)
//   ring controls     per ordered pair (src, dst): two cache lines (head, tail)
//   slots             per rank, two halves of chunkBytes each (page-aligned)
//   rings             per ordered pair: ringBytes of byte stream (touched only if used)
//
// Each line is written by one rank only (its owner), except the failure record, which the
// first rank to see a failure claims with a compare-and-swap, the `sleepers` counters,
// which waiters bump before sleeping, and the goodbyes, which are only ever set.

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "transport/failures.h"

namespace loom::shm {

inline constexpr size_t kCacheLine = 64;
inline constexpr size_t kPage = 4096;
inline constexpr uint64_t kMagic = 0x6d68732d6d6f6f6cULL;  // "loom-shm"
inline constexpr uint32_t kLayoutVersion = 5;

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared counters must be lock-free");

/// Why the communicator failed, shared by every rank. `state` goes 0 -> 1 (claimed, being
/// written) -> 2 (complete) exactly once.
struct alignas(kCacheLine) FailureRecord {
  std::atomic<uint32_t> state;
  int32_t code;      ///< loom::ErrorCode
  int32_t reporter;  ///< rank that wrote the record
  int32_t culprit;   ///< rank blamed (dead, timed out, mismatched), or -1
  char message[496];
};

/// A rank's phase counter. The low 32 bits of `posted` double as its futex word.
struct alignas(kCacheLine) RankLine {
  std::atomic<uint64_t> posted;
  std::atomic<uint32_t> sleepers;  ///< waiters asleep on `posted`
  std::atomic<uint32_t> state;     ///< loom::RankState
  int32_t pid;                     ///< written once when the rank attaches
  /// Per half: a hash of the OpDesc this rank wrote there, so a waiter that already holds
  /// this line can check agreement without fetching the descriptor's line too.
  uint64_t fingerprint[2];
  /// Progress for failure reports: the last collective this rank started and the last it
  /// finished (sequence numbers), and the kind it started. Written by the owner only,
  /// relaxed: readers use them to describe a hang, never to synchronise.
  std::atomic<uint64_t> startedSeq;
  std::atomic<uint64_t> finishedSeq;
  std::atomic<uint8_t> startedKind;
  /// 1 while the rank runs the completion callbacks of its last finished collective.
  std::atomic<uint8_t> inCallbacks;
};
static_assert(sizeof(RankLine) == kCacheLine, "a rank line is one cache line");

/// Wakes a rank's point-to-point engine: bumped by senders that wrote into its inbound
/// rings and by receivers that freed space in its outbound rings.
struct alignas(kCacheLine) Doorbell {
  std::atomic<uint32_t> rings;
  std::atomic<uint32_t> sleeping;
};

/// What a rank says it is doing, written with its first data of an operation so readers can
/// check that every rank issued the same operation.
struct alignas(kCacheLine) OpDesc {
  uint64_t seq;         ///< the operation's sequence number on the communicator
  uint64_t count;       ///< the operation's defining element count
  uint64_t countsHash;  ///< hash of per-rank counts for the V variants, else 0
  double factor;        ///< PREMUL_SUM factor
  uint8_t kind;         ///< CollectiveKind
  uint8_t type;         ///< DataType
  uint8_t reduce;       ///< ReduceKind
  uint8_t algorithm;    ///< Algorithm, or 0 where there is no choice
  int32_t root;
  uint64_t signatureHash;  ///< hash of the caller's signature (desync debug), else 0
  /// Algorithm::kPeerRead: this rank's LOOM_PEER_READ_BYTES and LOOM_PEER_READ_MAX_BYTES,
  /// which decide each all_to_all_v's path from its sizes there (else 0): ranks that differ
  /// would take different paths through the same phases.
  uint64_t peerReadFrom;
  uint64_t peerReadBelow;
};
static_assert(sizeof(OpDesc) == kCacheLine, "a descriptor is one cache line");

/// The caller's description of an operation ("shapes [4, 8]"), written beside the OpDesc
/// only in desync-debug mode, so a mismatch message can quote both sides.
struct alignas(kCacheLine) OpSignature {
  char text[128];
};

/// Where a rank's input to an operation lies when it lends it: a lending-pool region of its
/// process (Region: descriptor number, random id, capacity) and the bytes in it. fd < 0: the
/// input is not lent, and peers must not read it in place.
struct alignas(kCacheLine) LentBuffer {
  int32_t fd;
  uint8_t id[16];
  uint64_t capacity;
  uint64_t offset;
  uint64_t bytes;
};
static_assert(sizeof(LentBuffer) == kCacheLine, "a lent-buffer line is one cache line");

/// One ring's control: `head` (bytes written, by the sender) and `tail` (bytes consumed, by
/// the receiver), on separate lines so neither side's writes evict the other's.
struct RingControl {
  alignas(kCacheLine) std::atomic<uint64_t> head;
  alignas(kCacheLine) std::atomic<uint64_t> tail;
};

/// The first page.
struct alignas(kPage) SegmentHeader {
  uint64_t magic;
  uint32_t version;
  int32_t size;
  int32_t ranks;  ///< of the communicator, on every host (the goodbyes' length)
  uint64_t chunkBytes;
  uint64_t ringBytes;
  uint64_t totalBytes;
  uint8_t commId[16];
  FailureRecord failure;
};

/// Byte offsets of each area for a given (size, ranks, chunkBytes, ringBytes).
struct Layout {
  int size = 0;
  int ranks = 0;
  size_t chunkBytes = 0;
  size_t ringBytes = 0;
  size_t rankLines = 0;
  size_t doorbells = 0;
  size_t descs = 0;
  size_t signatures = 0;
  size_t lent = 0;
  size_t goodbyes = 0;
  size_t ringControls = 0;
  size_t slots = 0;
  size_t rings = 0;
  size_t total = 0;

  /// Computes the offsets for `size` ranks here of a communicator of `ranks`; chunkBytes
  /// and ringBytes must be multiples of kPage.
  static Layout compute(int size, int ranks, size_t chunkBytes, size_t ringBytes) {
    auto roundUp = [](size_t v, size_t a) { return (v + a - 1) / a * a; };
    const auto p = static_cast<size_t>(size);
    Layout l;
    l.size = size;
    l.ranks = ranks;
    l.chunkBytes = chunkBytes;
    l.ringBytes = ringBytes;
    l.rankLines = sizeof(SegmentHeader);
    l.doorbells = l.rankLines + p * sizeof(RankLine);
    l.descs = l.doorbells + p * sizeof(Doorbell);
    l.signatures = l.descs + 2 * p * sizeof(OpDesc);
    l.lent = l.signatures + 2 * p * sizeof(OpSignature);
    l.goodbyes = l.lent + 2 * p * sizeof(LentBuffer);
    l.ringControls = roundUp(l.goodbyes + static_cast<size_t>(ranks), kCacheLine);
    l.slots = roundUp(l.ringControls + p * p * sizeof(RingControl), kPage);
    l.rings = l.slots + 2 * p * chunkBytes;
    l.total = l.rings + p * p * ringBytes;
    return l;
  }
};

}  // namespace loom::shm
