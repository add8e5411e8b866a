#pragma once

// The arguments of loom's CUDA kernels (src/cuda/kernels.cu), shared by the kernels and
// the host code that launches them. Plain structs passed by value as the kernel's one
// parameter (under the 4 KiB every architecture takes); no CUDA header needed.

#include <algorithm>
#include <cstdint>

namespace loom::cuda {

/// Most ranks of one host that CUDA collectives span, so most sources one reduction reads,
/// and most peers one step checks.
inline constexpr int kMaxSources = 32;
/// Most segments one copy launch moves.
inline constexpr int kMaxSegments = 32;
/// Most pieces one spread copy launch moves (its parameters stay under 4 KiB).
inline constexpr int kMaxSpreadPieces = 120;

/// What a rank says it is doing in a step, so its peers can check they do the same: three
/// words (core/cuda_descriptors.h encodes them; kernels compare them, write a PREMUL_SUM
/// factor kept in device memory into the third, and add device counts to a replay's tags and
/// chunk numbers).
struct Descriptor {
  uint64_t words[3];
};

/// Written by a kernel that finds a peer doing something else; host memory the executor's
/// monitor polls. `raised` is set last, once the rest is written.
struct MismatchReport {
  int32_t peer;
  Descriptor mine;
  Descriptor theirs;
  volatile uint32_t raised;
};

/// Before a kernel works it checks its peers and publishes itself: each `expect` entry is a
/// peer's descriptor (in the peer's memory, published before the peer raised the flag this
/// rank waited for) that must equal `words`; each `publish` entry is written for peers to
/// check. On a disagreement the kernel reports it (the first to claim `claim` writes
/// `report`), sets `abort`, and does nothing else.
struct Agreement {
  struct Expect {
    const volatile Descriptor* theirs;
    Descriptor words;
    int32_t peer;
  };
  struct Publish {
    Descriptor* at;
    Descriptor words;
    int32_t peer;  ///< a transfer's receiver (pairCounts); -1 for a collective
  };
  Expect expect[kMaxSources];
  int nexpect;
  Publish publish[kMaxSources];
  int npublish;
  uint32_t* claim;           ///< device memory, zero until a disagreement is claimed
  MismatchReport* report;    ///< host memory mapped for the device
  volatile uint64_t* abort;  ///< nonzero: the communicator failed; do nothing
  /// A PREMUL_SUM factor in device memory (null: none): its bits are the third word of
  /// every descriptor above, expected and published, so ranks whose factors differ meet a
  /// named mismatch rather than sums that differ by rank.
  const double* factorAt;
  /// A captured call's (null: an eager one's): the device epoch before the call's first step
  /// as it is replayed, which the kernel adds to the step tag of every collective descriptor
  /// above (replayTagged).
  const uint64_t* replayEpoch;
  /// A captured transfer's (null: otherwise): this rank's pair counts in device memory,
  /// [peer][chunks sent, chunks taken], as the replay finds them. A transfer descriptor's third
  /// word is the pair's chunk number in its direction, which the host counts from the call's
  /// start; the kernel adds the count before it (sent for a published descriptor, taken for
  /// an expected one), so a chunk left from another call or replay never reads as this one.
  const uint64_t* pairCounts;
};

/// dst[i] = op over s = 0..nsrc-1, in that order, of srcs[s][i], for i < count; the
/// element type and op are in the kernel's name (loom_reduce_<type>_<op>, enum values).
struct ReduceParams {
  void* dst;
  const void* srcs[kMaxSources];
  int nsrc;
  uint64_t count;
  double factor;           ///< PREMUL_SUM's factor
  const double* factorAt;  ///< PREMUL_SUM's factor in device memory, read instead (null: none)
  double divisor;          ///< AVG's: the number of ranks
  Agreement agreement;
};

/// One contiguous copy.
struct Segment {
  void* dst;
  const void* src;
  uint64_t bytes;
};

/// Copies every segment (blockIdx.y picks the segment): loom_copy.
struct CopyParams {
  Segment segments[kMaxSegments];
  int count;
  Agreement agreement;
};

/// Copies every piece, the bytes of all laid end to end and cut into equal runs, one per
/// block, so blocks share the work evenly however the pieces' sizes differ: loom_copy_spread.
/// Piece i covers bytes [starts[i], starts[i] + pieces[i].bytes) of the whole; starts and
/// perBlock are multiples of 16, so a run boundary inside an aligned piece stays aligned.
struct SpreadParams {
  Segment pieces[kMaxSpreadPieces];
  uint64_t starts[kMaxSpreadPieces];
  int count;
  uint64_t perBlock;
};

/// Most block pairs (one pushing, one receiving) a fused collective runs.
inline constexpr int kMaxFusedBlocks = 64;
/// Two-shot's three roles in the room that two roles of kMaxFusedBlocks are known to fit
/// (Kernels::fusedFits): the same bound on every rank, whatever its GPU.
inline constexpr int kMaxTwoShotBlocks = 2 * kMaxFusedBlocks / 3;

/// Whether a GPU that keeps `resident` fused blocks at once fits every fused kernel's
/// kMaxFusedBlocks block pairs, as a cooperative launch needs.
inline bool fusedFitsIn(int resident) {
  return resident >= 2 * kMaxFusedBlocks;
}
/// The most blocks one rank's fused grid may take where `crowd` ranks spin on one GPU that
/// keeps `resident` fused blocks at once: an equal share each, so that every rank's grid is
/// placed together (a block still waiting for room would hold up the peers' blocks that wait
/// for it), and never more than two roles of kMaxFusedBlocks. Below 3 no fused call fits.
inline int fusedGridShare(int resident, int crowd) {
  return crowd < 1 ? 0 : std::min(2 * kMaxFusedBlocks, resident / crowd);
}
/// The most block pairs of a fused call of one or two roles within `share` (and `blocks`,
/// the configured most).
inline int fusedBlocksWithin(int share, int blocks) {
  return std::min(blocks, share / 2);
}
/// The most blocks per role of a two-shot call (three roles) within `share`.
inline int twoShotBlocksWithin(int share, int blocks) {
  return std::min({blocks, kMaxTwoShotBlocks, share / 3});
}

/// A whole collective in one launch, for ranks that each have a GPU of their own
/// (loom_fused_<type>_<op> reduces, loom_fused_copy copies; cooperative, 2 x blocks blocks,
/// 3 x blocks for two-shot, `blocks` for a chain).
/// The call runs in steps of perStep elements (bytes for a copy), step i in epoch
/// firstEpoch + i, over element offsets [i x perStep, ...) of every part. Its blocks play
/// roles (fusedRole): pushing block b pushes its slice of each step of sources[q] into rank q's
/// slot (the region there for this rank), for every q in pushesTo, then raises "arrived" in q's
/// flags and in its own; receiving block b waits for the arrivals of every rank in receivesFrom and
/// its own, then reduces its slice (sources in rank order: `own` for this rank, the regions of its
/// slot for the others) into outputs[0], or copies each region of rank q to outputs[q] and `own` to
/// outputs[rank], and raises "freed" in each sender's flags, which that sender's pusher waits for
/// before it writes the same slot again `depth` steps later. Every wait polls the rank's own
/// memory. The first step also publishes this rank's descriptor (and raises its collective "ready"
/// flag, so a peer running a different operation can name the mismatch) and checks the descriptor
/// of every rank it receives from.
///
/// Two-shot (`twoShot`; all_reduce, or broadcast from `root`): a step is twoShotShares
/// shares of `share` elements, one per owner (all_reduce: every rank; broadcast: every rank
/// but the root). Scattering block b pushes slice b of owner q's share of `own` to q's reduce
/// region for this rank (all_reduce: every rank; broadcast: the root alone); owning block
/// b of an owner reduces slice b of its share from `own` and those regions into
/// outputs[0] (broadcast: copies the root's), pushes the result into every other owner's
/// gather region for this rank (at gatherAt in the slot) and raises "gathered" there;
/// gathering block b copies each other owner's gathered slice into outputs[0] and raises
/// "gather freed" in that owner's flags, which its owning block b waits for `depth` steps
/// later (broadcast's root copies its input into its output instead). Every block sends to
/// its peers in turn from a place of its own (fusedPeerInTurn), never all to one at once.
struct FusedParams {
  const void* sources[kMaxSources];  ///< by receiving rank
  const void* own;                   ///< this rank's own part (null: none)
  void* outputs[kMaxSources];
  uint32_t pushesTo;      ///< ranks, as bits
  uint32_t receivesFrom;  ///< ranks, as bits
  /// Ranks, as bits, whose first-step descriptor this rank checks though it takes nothing
  /// from them (a broadcast's root: every peer; see checkQuietPeers).
  uint32_t checksQuiet;
  uint64_t count;       ///< elements of every part
  uint64_t perStep;     ///< elements per step: a multiple of 16 bytes' worth
  uint64_t firstEpoch;  ///< of step 0
  uint64_t steps;
  int32_t blocks;  ///< block pairs; every rank runs as many
  int32_t rank;
  int32_t size;
  uint8_t* slots[kMaxSources];  ///< rank q's slot 0 (slot k at + k x slotBytes)
  uint64_t slotBytes;           ///< from one slot to the next
  uint64_t regionBytes;         ///< a sender's region in a slot
  int32_t depth;  ///< slots: step epoch e uses slot e % depth, freed by step e - depth
  /// Along a chain (`blocks` blocks of one role; a slot holds one step or hop from the rank
  /// before).
  /// A broadcast (chainLinks; a copy): each rank but the root waits for block b's slice of a
  /// step from the rank before it, copies it to outputs[0] and, in the same pass, into the
  /// next rank's slot, raises "arrived" there and "freed" in the rank before it; the root
  /// pushes `own`. An all_reduce (root < 0) goes around the ring: a step is `size` shares of
  /// `share` elements, and each of its ringHops(size) hops is epoch firstEpoch + step x hops +
  /// hop. In pass k of a step (ringShare) a rank takes share ringShare(rank, size, k) from
  /// hop k - 1, adds `own`'s (passes below size; pass size - 1 finishes the share into
  /// outputs[0]) or copies it to outputs[0] (later passes), and sends the result on as hop k.
  int32_t chain;
  int32_t twoShot;    ///< in two shots (3 x blocks blocks; above)
  int32_t root;       ///< two-shot and chain: the broadcast's root, or -1 for all_reduce
  uint64_t share;     ///< two-shot and ring: elements of a share (perStep = shares x share)
  uint64_t gatherAt;  ///< two-shot: where the gather regions start in a slot
  /// Rank q's block flags: arrived[sender][block], freed[reader][block], and for two-shot
  /// gathered[sender][block] and gatherFreed[reader][block].
  uint64_t* blockFlags[kMaxSources];
  uint64_t* ready[kMaxSources];          ///< rank q's collective "ready" flag of the first step
  Descriptor* descriptors[kMaxSources];  ///< rank q's descriptor of the first step
  Descriptor mine;  ///< with factorAt, the kernel writes the factor's bits into word 2
  double factor;    ///< PREMUL_SUM's factor
  /// PREMUL_SUM's factor in device memory, read instead (null: none).
  const double* factorAt;
  double divisor;  ///< AVG's: the number of ranks
  uint32_t* claim;
  MismatchReport* report;
  volatile uint64_t* abort;
  /// The call's bounds, kept inside the kernel (each would otherwise be a batch of stream
  /// memory operations around the launch, a driver call on the host's path): every block
  /// first waits until each peer is done with the slots of the two epochs before
  /// firstEpoch, and the last block to finish raises this rank's "done" of lastEpoch and
  /// lastEpoch - 1 (of lastEpoch alone in a one-epoch call). Rank q's "done" flag of an
  /// epoch sits toDone bytes after ready[q] if the epoch has firstEpoch's parity, and
  /// toOtherParity bytes further if not.
  int64_t toDone;
  int64_t toOtherParity;
  uint64_t lastEpoch;
  uint64_t* exits;         ///< this rank's count of fused blocks that have finished, ever
  uint64_t exitsWhenDone;  ///< its value once this call's last block has finished
  /// Debug (LOOM_CUDA_FUSED_TRACE): where thread 0 of every block records, for each of the
  /// first traceSteps steps, the GPU's global time (ns) at each of kTracePhases points, at
  /// [(blockIdx.x x traceSteps + step) x kTracePhases + phase]; null: not traced.
  uint64_t* trace;
  uint64_t traceSteps;
  uint32_t* traceSms;  ///< debug: the SM each block ran on, by blockIdx.x (with trace)
};

/// A fused transfer cuts every chunk into this many pieces, each with its own flags and
/// descriptor copy, and runs a power of two up to this many blocks per direction of traffic
/// with one peer, each moving as many whole pieces.
inline constexpr int kTransferPieces = 64;
/// Most messages (sends and receives together) one fused transfer call moves: its table
/// has room for this many in the rank's workspace.
inline constexpr int kMaxTransferMessages = 4096;

/// One message of a fused transfer call (TransferParams).
struct TransferMessage {
  uint8_t* data;  ///< read for a send, written for a receive
  uint64_t bytes;
  uint64_t word0;  ///< its chunks' descriptor's first word; the second is bytes | chunk << 40
};

/// One direction of a call's traffic with one peer: messages [first, first + count) of the
/// table, in issue order, travelling as the pair's chunks number chunksBefore + 1 onwards
/// (each message at least one chunk, so an empty one still carries its descriptor).
struct TransferStream {
  int32_t peer;
  int32_t sends;  ///< 1: to the peer; 0: from it
  int32_t first;
  int32_t count;
  uint64_t chunksBefore;  ///< the pair's chunks in this direction before this call
};

/// The sends and receives of one call in one launch, for ranks that each have a GPU of their
/// own, where the stepped path pays a round of stream waits and launches per chunk (on two
/// H200s it moved 52 GB/s against NCCL's 352; docs/PERFORMANCE.md). Each chunk (a mailbox
/// slot's worth) is cut into kTransferPieces pieces (fusedSlices of a whole slot). Each stream
/// has `blocks` blocks (grid block i serves stream i % nstreams as its block i / nstreams),
/// and each block moves kTransferPieces / blocks neighbouring pieces of every chunk of its
/// stream. For each of its pieces a sending block waits until the receiver has taken that
/// piece of the chunk two before (which went through the same mailbox slot), writes it into
/// the receiver's mailbox over NVLink, and raises the piece's "sent" flag in the receiver's
/// workspace to the chunk's number; the receiving block waits for those flags (polling its
/// own memory), checks each piece's descriptor, copies its pieces out and raises their
/// "taken" flags in the sender's workspace. The flags count per piece, not per block, so the
/// two ends of a pair may run different numbers of blocks: each rank sizes its grid from its
/// own call (few streams get more blocks each). No block waits for another block of its own
/// grid, and every direction of every pair moves at once (no deadlock within a call).
struct TransferParams {
  const TransferStream* streams;    ///< device memory: the call's table
  const TransferMessage* messages;  ///< device memory: the call's table
  int32_t nstreams;
  int32_t blocks;  ///< per stream: a power of two up to kTransferPieces
  int32_t rank;
  uint64_t mailSlot;                  ///< bytes per mailbox slot
  uint8_t* mailboxes[kMaxSources];    ///< rank q's: sender s's slot k at (2 s + k) x mailSlot
  uint64_t* sentFlags[kMaxSources];   ///< rank q's: [sender][piece]
  uint64_t* takenFlags[kMaxSources];  ///< rank q's: [receiver][piece]
  Descriptor* chunkDescriptors[kMaxSources];  ///< rank q's: [sender][chunk parity][piece]
  uint32_t* claim;
  MismatchReport* report;
  volatile uint64_t* abort;
};

#if defined(__CUDACC__)
#define LOOM_HOST_DEVICE __host__ __device__
#else
#define LOOM_HOST_DEVICE
#endif

/// Where a collective's step tag sits in word 1 of its descriptor (core/cuda_descriptors.h).
inline constexpr int kStepTagShift = 48;

/// Collective descriptor `d`, step-tagged by the host with a step counted from its captured
/// call's start, as a replay of the call starting at device epoch `start` runs it: tagged
/// with the step's device epoch (mod 2^16, as every tag). So what a stopped peer left in an earlier
/// replay of the same graph reads as another step's (stale), never as this one's.
LOOM_HOST_DEVICE inline Descriptor replayTagged(Descriptor d, uint64_t start) {
  d.words[1] += start << kStepTagShift;  // the carry out of the tag's 16 bits falls off
  return d;
}

/// Transfer descriptor `d` with a chunk number counted from its captured call's start, as a
/// replay runs it: counted on from the pair's count before the replay (Agreement::pairCounts;
/// null: an eager call's, whose numbers are whole already), sent to or taken from `peer`.
LOOM_HOST_DEVICE inline Descriptor sequenced(Descriptor d, const uint64_t* pairCounts, int peer,
                                             bool taken) {
  if (pairCounts != nullptr) d.words[2] += pairCounts[2 * peer + (taken ? 1 : 0)];
  return d;
}

/// The blocks a fused call's grid has: `blocks` per role, and a chain has one role, two
/// shots three, one shot two (pushing and receiving).
LOOM_HOST_DEVICE inline unsigned fusedGridBlocks(const FusedParams& p) {
  const unsigned roles = p.chain ? 1 : p.twoShot ? 3 : 2;
  return roles * static_cast<unsigned>(p.blocks);
}

/// The last piece of `p` that starts at or before byte `begin` of the whole: the first one
/// the run starting there copies from (the kernel per block; the tests on the host).
LOOM_HOST_DEVICE inline int firstSpreadPiece(const SpreadParams& p, uint64_t begin) {
  int first = 0;
  for (int lo = 0, hi = p.count - 1; lo <= hi;) {
    const int mid = (lo + hi) / 2;
    if (p.starts[mid] <= begin) {
      first = mid;
      lo = mid + 1;
    } else {
      hi = mid - 1;
    }
  }
  return first;
}

/// Bytes [*from, *to) of piece i that the run [begin, end) of the whole covers; false if none.
LOOM_HOST_DEVICE inline bool spreadSlice(const SpreadParams& p, int i, uint64_t begin, uint64_t end,
                                         uint64_t* from, uint64_t* to) {
  const uint64_t start = p.starts[i];
  const uint64_t stop = start + p.pieces[i].bytes;
  *from = (begin > start ? begin : start) - start;
  *to = (end < stop ? end : stop) - start;
  return *from < *to;
}

/// Elements [from, to) of a fused step of `n` elements that block `block` of `blocks` moves:
/// its share of the call's first step of `first` elements (whole vectors of `vector`
/// elements), cut short where the step ends. A receiving block frees only its pushing
/// counterpart's slice, so a block's slice must lie in the same place in every step: cut
/// from a short last step's size instead, block b would overwrite bytes that another block
/// of the receiver may still be reading from two steps before.
struct FusedSlice {
  uint64_t from;
  uint64_t to;
};
LOOM_HOST_DEVICE inline FusedSlice fusedSlice(uint64_t first, uint64_t n, int blocks, int block,
                                              uint64_t vector) {
  const uint64_t per = ((first + blocks - 1) / blocks + vector - 1) / vector * vector;
  const uint64_t at = static_cast<uint64_t>(block) * per;
  const uint64_t from = at < n ? at : n;
  return {from, from + per < n ? from + per : n};
}

/// A fused transfer block's share of a chunk of `n` bytes (TransferParams): pieces [first,
/// first + count) and their bytes [from, to). Pieces are fusedSlices of a whole mailbox slot,
/// so a piece lies in the same place in every chunk and for every number of blocks: the two
/// ends of a pair may run different grids.
struct TransferPieces {
  int first;
  int count;
  uint64_t from;
  uint64_t to;
};
LOOM_HOST_DEVICE inline TransferPieces transferPieces(uint64_t mailSlot, int blocks, int block,
                                                      uint64_t n) {
  const int per = kTransferPieces / blocks;
  const int first = block * per;
  return {first, per, fusedSlice(mailSlot, n, kTransferPieces, first, 16).from,
          fusedSlice(mailSlot, n, kTransferPieces, first + per - 1, 16).to};
}

/// Two-shot: how many ranks own a share of each step. Broadcast's root owns none, so it
/// sends every byte once (a share to each owner), as a ring's root does.
LOOM_HOST_DEVICE inline int twoShotShares(int size, int root) {
  return root < 0 ? size : size - 1;
}

/// Two-shot: where owner q's share lies in a step (root < 0: all_reduce, every rank owns one).
LOOM_HOST_DEVICE inline int twoShotShareIndex(int q, int root) {
  return root >= 0 && q > root ? q - 1 : q;
}

/// A chained broadcast's order: the i-th link is rank (root + i) % size; each link receives
/// from the one before it and passes on to the one after it (-1: none), so every GPU has one
/// sender and one receiver, as in NCCL's ring, where two shots had each owner take the
/// message from three (docs/PERFORMANCE.md, "A chained broadcast").
struct ChainLinks {
  int prev;
  int next;
};
LOOM_HOST_DEVICE inline ChainLinks chainLinks(int rank, int size, int root) {
  const int at = (rank - root + size) % size;
  return {at > 0 ? (rank + size - 1) % size : -1, at < size - 1 ? (rank + 1) % size : -1};
}

/// A ring all_reduce's hops per step (FusedParams::chain with root < 0): size - 1 to reduce
/// the shares, size - 1 to pass the finished ones round.
LOOM_HOST_DEVICE inline int ringHops(int size) {
  return 2 * (size - 1);
}

/// Whether a ring all_reduce can reduce elements of DataType `type` with ReduceKind `kind`
/// (enum values, as in the kernels' names): only where the kernels accumulate in the element
/// type itself, since a ring carries partial sums from rank to rank in it. float16 and
/// bfloat16 (2, 3) add in float32, and AVG (4) of 8- to 32-bit integers (4-7) in int64;
/// those keep two shots. kernels.cu checks this against every kernel it builds.
LOOM_HOST_DEVICE constexpr bool ringReduces(int type, int kind) {
  return type != 2 && type != 3 && !(kind == 4 && type >= 4 && type <= 7);
}

/// The share of a step that `rank` of a ring all_reduce works on in pass `pass` (0 to
/// ringHops): pass 0 sends its own share, pass k takes what pass k - 1 of the rank before it
/// sent, so each share starts at its own rank, has every rank's part added by the rank
/// before it (pass size - 1), and then goes round once more, as in NCCL's ring: one sender
/// and one receiver per GPU, where two shots had each rank take a share from every other.
LOOM_HOST_DEVICE inline int ringShare(int rank, int size, int pass) {
  return ((rank - pass) % size + size) % size;
}

/// The k-th peer (k < size - 1) that block `block` of `rank` sends to within a fused step.
/// Each rank starts one place further on than the rank before it, so at every turn the ranks
/// send to distinct peers (a shift), where sending in rank order had every rank's link pour
/// into the same peer while the others' idled (four GPUs: 0.70-0.76x NCCL's all_reduce bus
/// bandwidth in rank order, 0.78-0.84x in turns, docs/PERFORMANCE.md); each block starts
/// one place further on than the block before it, so one rank's blocks keep every peer busy.
LOOM_HOST_DEVICE inline int fusedPeerInTurn(int rank, int size, int block, int k) {
  return (rank + 1 + (block + k) % (size - 1)) % size;
}

/// The role (0: push, 1: receive; two-shot: 0 scatter, 1 own, 2 gather) that grid block
/// `index` of a fused kernel of `roles` roles plays: roles take turns over the grid, so each
/// role's blocks spread over the whole GPU. (With a range of the grid per role, a role's
/// blocks sat on fewer parts of the GPU, and a broadcast root's pushing blocks wrote at rates
/// up to 2.1x apart, against 1.3x in turns; docs/PERFORMANCE.md, "Broadcast's root, step by
/// step".)
LOOM_HOST_DEVICE inline int fusedRole(int index, int roles) {
  return index % roles;
}
/// Which of its role's blocks grid block `index` is.
LOOM_HOST_DEVICE inline int fusedRoleBlock(int index, int roles) {
  return index / roles;
}

/// The points of a fused step that LOOM_CUDA_FUSED_TRACE records: the step begins, its first
/// wait for peers ends, its second wait ends (the same as the first where there is one), and
/// its work is done and its flags raised. A ring all_reduce's step, of many passes: it
/// begins, its first hop has arrived, its adding passes are done, its copying passes are done.
inline constexpr int kTracePhases = 4;

/// A wait for a flag (until flag >= *base + offset, compared as a signed difference) or a
/// write of one (flag = *base + offset, released at system scope).
struct FlagOp {
  uint64_t* flag;
  const uint64_t* base;
  uint64_t offset;
  int32_t wait;
};

/// `*word += by`, after a call's flag operations.
struct Advance {
  uint64_t* word;
  uint64_t by;
};

/// Flag waits and writes, in order, relative to counters in device memory: what operations
/// captured in a CUDA graph use, since each replay runs at counts the host never sees
/// (loom_flags). Afterwards each advance is applied. The counters are this rank's own, and
/// only its captured calls write them, one after another (the executor orders them).
struct FlagParams {
  FlagOp ops[kMaxSources];
  int count;
  Advance advances[2 * kMaxSources + 1];
  int nadvance;
  const volatile uint64_t* abort;  ///< nonzero: stop waiting
  /// This rank's record of the wait in progress, for its monitor (a peer that left never
  /// raises the flag, and a replay has no deadline): the value, then the flag's address,
  /// which goes back to 0 once the wait is over.
  volatile uint64_t* waiting;
};

}  // namespace loom::cuda
