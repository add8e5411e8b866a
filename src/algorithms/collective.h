#pragma once

// What every collective algorithm receives: its arguments (CollectiveArgs) and the means
// to run (CollectiveContext: the phase protocol of ShmComm plus parallel copy and reduce).
// Each algorithm is a free function in its own file; run() picks one by kind and size.
//
// Every collective starts with the same first phase, an "opening": each rank writes its
// OpDesc, posts, waits for all ranks and checks that all descriptors agree. So ranks that
// issue different collectives, counts, types, roots or algorithms get a kMismatch error
// naming both sides instead of a hang or a wrong answer, and the first phase doubles as the
// wait that makes later beginWrite() calls free.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "algorithms/selection.h"
#include "kernels/reduce.h"
#include "loom/types.h"
#include "transport/shm/shm_comm.h"
#include "util/helper_pool.h"
#include "util/per_rank.h"

namespace loom {

enum class CollectiveKind : uint8_t {
  kAllReduce = 1,
  kReduce,
  kBroadcast,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kGather,
  kScatter,
  kBarrier,
};

/// "all_reduce", "broadcast", ... (inline: a call names itself several times)
constexpr std::string_view collectiveName(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kReduce: return "reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllToAll: return "all_to_all";
    case CollectiveKind::kGather: return "gather";
    case CollectiveKind::kScatter: return "scatter";
    case CollectiveKind::kBarrier: return "barrier";
  }
  return "collective";
}

/// True for the collectives that apply a reduction (all_reduce, reduce, reduce_scatter).
constexpr bool reduces(CollectiveKind kind) {
  return kind == CollectiveKind::kAllReduce || kind == CollectiveKind::kReduce ||
         kind == CollectiveKind::kReduceScatter;
}

/// True for the collectives with a root (reduce, broadcast, gather, scatter).
constexpr bool hasRoot(CollectiveKind kind) {
  return kind == CollectiveKind::kReduce || kind == CollectiveKind::kBroadcast ||
         kind == CollectiveKind::kGather || kind == CollectiveKind::kScatter;
}

/// The arguments of one collective, as validated by the Communicator. Per-rank blocks are
/// pointer + count pairs, so both contiguous buffers and lists of tensors fit.
struct CollectiveArgs {
  /// The common fields; the per-rank lists start empty.
  static CollectiveArgs of(CollectiveKind kind, DataType type, ReduceOp op, int root, size_t count,
                           const void* input, void* output) {
    CollectiveArgs a;
    a.kind = kind;
    a.type = type;
    a.op = op;
    a.root = root;
    a.count = count;
    a.input = input;
    a.output = output;
    return a;
  }

  CollectiveKind kind = CollectiveKind::kBarrier;
  DataType type = DataType::kFloat32;
  ReduceOp op;
  int root = 0;
  /// The defining count: whole buffer (all_reduce, reduce, broadcast) or per rank (the rest).
  size_t count = 0;
  const void* input = nullptr;
  void* output = nullptr;
  std::vector<const void*> inputs;  ///< per destination rank (reduce_scatter, all_to_all, scatter)
  std::vector<size_t> inputCounts;
  std::vector<void*> outputs;  ///< per source rank (all_gather, all_to_all, gather)
  std::vector<size_t> outputCounts;
  bool variable = false;    ///< a V variant: per-rank counts may differ
  uint64_t countsHash = 0;  ///< hash of the counts every rank must agree on (V variants)
  std::string signature;    ///< the caller's description, checked across ranks if not empty
  /// Fills in the buffers and counts as the call starts, on the thread that runs it
  /// (Communicator::allGatherVPlaced); empty for every other call.
  std::function<void(CollectiveArgs&)> place;
};

/// The countsHash of every all_to_all_v: its counts are each rank's own (its sends), so none
/// can be agreed on, but the uneven form must not read as the even one of count 0 (both
/// describe count 0), or a rank taking one and its peer the other would read counts the peer
/// never wrote.
inline constexpr uint64_t kUnevenAllToAllHash = 0x7665'6e65'7675'6e65ULL;

/// One contiguous copy, for batching several into one parallel region.
struct CopyTask {
  void* dst;
  const void* src;
  size_t bytes;
};

/// How collectives use the host, from Config (LOOM_THREADS, LOOM_STREAM_BYTES, LOOM_ALGO).
struct Tuning {
  int threads = 1;                     ///< threads per rank for large copies and reductions
  size_t streamBytes = SIZE_MAX;       ///< per-rank output size from which outputs stream
  size_t lendBytes = SIZE_MAX;         ///< all_gather output / reduce_scatter input size from which
                                       ///< lent inputs are read in place
  size_t peerReadBytes = SIZE_MAX;     ///< all_to_all size (whole exchange) from which it
                                       ///< copies out of peers' memory
  size_t peerReadMaxBytes = SIZE_MAX;  ///< ... and below which
  SelectionTable selection;
};

/// The running state of one collective on one rank.
class CollectiveContext {
 public:
  CollectiveContext(shm::ShmComm& shm, Failures& failures, const WaitSpec& wait, uint64_t seq,
                    uint64_t& phase, const Tuning& tuning)
      : shm_(shm), failures_(failures), wait_(wait), seq_(seq), phase_(phase), tuning_(tuning) {}

  /// Sets the collective this context runs and the algorithm chosen for it (before the
  /// first startPhase; both go into the opening descriptor).
  void begin(const CollectiveArgs& args, Algorithm algorithm) {
    args_ = &args;
    algorithm_ = algorithm;
  }

  /// Where a failure found by an algorithm (a mismatch) is recorded.
  Failures& failures() const { return failures_; }
  int rank() const { return shm_.rank(); }
  int size() const { return shm_.size(); }
  /// The communicator's rank of this step's rank q (errors name those).
  int communicatorRank(int q) const { return shm_.communicatorRank(q); }
  size_t chunkBytes() const { return shm_.chunkBytes(); }
  const SelectionTable& selection() const { return tuning_.selection; }
  /// True if an output of `bytes` per rank should be written with streaming stores.
  bool streams(size_t bytes) const { return bytes >= tuning_.streamBytes; }

  /// True if an all_gather (whole output) or reduce_scatter (whole input) of `bytes` per
  /// rank reads lent inputs in place (Algorithm::kLent).
  bool lendsAt(size_t bytes) const { return bytes >= tuning_.lendBytes; }
  /// Whether every rank's process had lendable memory at the last collective's opening.
  bool everyRankLends() const { return shm_.everyRankLends(); }
  /// True if this collective runs Algorithm::kLent (chosen with lendsAt by runCollective).
  bool lends() const { return algorithm_ == Algorithm::kLent; }
  /// Opens the collective (its first phase) with this rank's input, `bytes[rank]` bytes
  /// from `input` (nullptr: not lendable), lent if it lies in the lending pool; `bytes[q]`
  /// is what this rank will read of rank q's. Returns every rank's input as this rank reads
  /// it in place (its own as given) if every rank lent its input and every rank could map
  /// every other's; else an empty vector, on every rank alike, and the caller stages the
  /// data as usual in the phases that follow. All-lent costs a second phase, to agree.
  std::vector<const uint8_t*> openLent(const void* input, std::span<const size_t> bytes);
  /// Ends a collective whose peers read inputs where they lie (lent, or out of the owner's
  /// process): waits until every rank has read what it needs, so no rank returns (and lets
  /// its caller overwrite its input) while a peer still reads it.
  void closeReads();

  /// True if an all_to_all of `bytes` (the whole exchange) copies out of peers' memory
  /// (Algorithm::kPeerRead): from LOOM_PEER_READ_BYTES and below LOOM_PEER_READ_MAX_BYTES,
  /// unless a probe found that some rank cannot read another.
  bool peerReadsAt(size_t bytes) const {
    return tuning_.peerReadBytes != SIZE_MAX && bytes >= tuning_.peerReadBytes &&
           bytes < tuning_.peerReadMaxBytes && shm_.peerReads() != shm::ShmComm::PeerReads::kNo;
  }
  /// True if an all_to_all whose size is not yet known (per-pair counts) may read peers.
  bool peerReadsPossible() const {
    return tuning_.peerReadBytes != SIZE_MAX && tuning_.peerReadBytes < tuning_.peerReadMaxBytes &&
           shm_.peerReads() != shm::ShmComm::PeerReads::kNo;
  }
  /// True if this collective runs Algorithm::kPeerRead. Its opening phase then carries this
  /// rank's probe and the addresses its peers read (peerWords), the reads need no further
  /// phase, and closeReads() ends it.
  bool readsPeers() const { return algorithm_ == Algorithm::kPeerRead; }
  /// The words rank q publishes in the opening phase p of a peer-read collective, after
  /// loom's own (at most chunkBytes / 8 - 2 of them): the algorithm fills this rank's before
  /// finishPhase(p) and reads its peers' after.
  uint64_t* peerWords(int q, uint64_t p) const {
    return reinterpret_cast<uint64_t*>(slot(q, p)) + kPeerWordsOffset;
  }
  /// After the opening phase p: true if every rank can read every other's memory, probed
  /// (in one more phase) the first time a communicator asks, the same answer on every rank.
  /// False: the caller stages the data as usual in the phases that follow.
  bool peersReadable(uint64_t p);
  /// A copy out of peer `peer`'s memory (its address there) into this process.
  struct PeerCopy {
    void* dst;
    int peer;
    const void* src;
    size_t bytes;
  };
  /// Performs the copies, split across helper threads when large. A read the kernel refuses
  /// fails the collective with an error naming the peer.
  void readPeers(std::span<const PeerCopy> tasks);

  /// Who a rank waits for after posting a phase, before it reads.
  enum class Await : uint8_t {
    kNobody,  ///< it reads nothing in this phase
    kAll,     ///< every rank
    kRoot,    ///< the collective's root
  };

  /// Starts the collective's next phase and returns its number. The first phase is the
  /// opening: it writes this rank's descriptor. A later phase in which this rank `writes`
  /// first waits until the half it reuses is free (a rank that only reads skips that wait).
  uint64_t startPhase(bool writes);
  /// Ends phase p: posts it (this rank's writes are complete and it is done reading every
  /// earlier phase), then waits for the ranks it reads. Every rank waits for all in the
  /// opening phase and checks their descriptors, whatever `await` says.
  void finishPhase(uint64_t p, Await await);

  uint8_t* slot(int q, uint64_t p) const { return shm_.slot(q, p); }

  /// Performs the copies, split across helper threads when large; `streaming` writes the
  /// destinations with non-temporal stores (for outputs too large to stay in cache).
  void copy(std::span<const CopyTask> tasks, bool streaming = false);
  void copy(void* dst, const void* src, size_t bytes, bool streaming = false) {
    const CopyTask task{dst, src, bytes};
    copy(std::span<const CopyTask>(&task, 1), streaming);
  }
  /// kernels::reduce over `count` elements, split across helper threads when large.
  void reduce(void* dst, std::span<const void* const> srcs, size_t count,
              const kernels::ReduceSpec& spec);

 private:
  // The words of a peer-read opening before the algorithm's: this rank's ReadProbe.
  static constexpr size_t kPeerWordsOffset = 2;

  int partsFor(size_t bytes) const;
  // Fails the collective: reading rank q's memory returned errno `error`.
  [[noreturn]] void peerReadFailed(int q, int error);
  // The opening phase: its first part writes this rank's descriptor, its second (after the
  // post) waits for every rank and checks their descriptors against it.
  void open(uint64_t p);
  void verifyAll(uint64_t p);

  shm::ShmComm& shm_;
  Failures& failures_;
  const WaitSpec& wait_;
  uint64_t seq_;
  uint64_t& phase_;
  const Tuning& tuning_;
  const CollectiveArgs* args_ = nullptr;
  Algorithm algorithm_{};
  uint64_t opening_ = 0;  // the opening phase's number, once started
  shm::OpDesc mine_{};
  uint64_t fingerprint_ = 0;
  const std::string* signature_ = nullptr;  // this rank's, for mismatch messages
};

/// Runs the collective described by `args`.
void runCollective(CollectiveContext& ctx, const CollectiveArgs& args);

// The algorithms (one file each; all_reduce and reduce share reduction.cc). A reduction's
// result lands on the ranks that `receive`: every rank for all_reduce, the root for reduce.
void reduceOneShot(CollectiveContext& ctx, const CollectiveArgs& args, bool receives);
void reduceTwoShot(CollectiveContext& ctx, const CollectiveArgs& args, bool receives);
void broadcast(CollectiveContext& ctx, const CollectiveArgs& args);
void allGather(CollectiveContext& ctx, const CollectiveArgs& args);
void reduceScatter(CollectiveContext& ctx, const CollectiveArgs& args);
void allToAll(CollectiveContext& ctx, const CollectiveArgs& args);
void gather(CollectiveContext& ctx, const CollectiveArgs& args);
void scatter(CollectiveContext& ctx, const CollectiveArgs& args);
void barrier(CollectiveContext& ctx, const CollectiveArgs& args);

/// Element range [begin, end) of slice `part` of `parts` over `count` elements, with
/// interior bounds rounded down to multiples of `align` elements.
inline std::pair<size_t, size_t> sliceOf(size_t count, int part, int parts, size_t align) {
  auto bound = [&](int k) -> size_t {
    if (k >= parts) return count;
    const size_t raw = static_cast<size_t>(static_cast<unsigned __int128>(count) * k / parts);
    return raw / align * align;
  };
  return {bound(part), bound(part + 1)};
}

/// Chunks of `perChunk` elements that `count` elements take; at least one, because the
/// opening phase runs even for an empty collective.
inline size_t chunksOf(size_t count, size_t perChunk) {
  return count == 0 ? 1 : (count + perChunk - 1) / perChunk;
}

/// Elements of each per-destination region of a slot (reduce_scatter, all_to_all,
/// scatter): a 1/size share of a chunk, in whole cache lines.
size_t regionElements(const CollectiveContext& ctx, DataType type);

/// True if the byte ranges [a, a + aBytes) and [b, b + bBytes) share a byte.
inline bool rangesOverlap(const void* a, size_t aBytes, const void* b, size_t bBytes) {
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  return aBytes != 0 && bBytes != 0 && x < y + bBytes && y < x + aBytes;
}

/// Elements per 64-byte cache line (at least 1).
inline size_t lineElements(DataType type) {
  return 64 / elementSize(type);
}

}  // namespace loom
