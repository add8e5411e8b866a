// The opening phase's checks, parallel data movement, and dispatch to the algorithms.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string>

#include "algorithms/collective.h"
#include "kernels/copy.h"
#include "transport/shm/lending.h"
#include "transport/shm/peer_reads.h"
#include "util/trace.h"
#include "util/word_hash.h"

namespace loom {

namespace {

// Below this many bytes per part, a helper costs more than it saves. A helper that wakes
// late no longer holds up a call (the pieces below), so parts can be small: 64 KiB parts
// ran P = 4's calls of 256 KiB-2 MiB through torch in 0.24-0.80x of the time with 256 KiB
// parts, at 64-128 KiB as before, and P = 8's 128-512 KiB, where the two differ, in
// 0.64-1.11x (PERFORMANCE.md, "Pieces a helper has not begun" and "Parts of 64 KiB at P = 8").
constexpr size_t kMinBytesPerPart = 64 << 10;

// Each thread's part is cut into this many pieces, which it runs in order unless a thread
// done with its own part takes some: a helper that wakes late (tens to hundreds of
// microseconds where the CPUs idle between calls) then holds up no one.
constexpr int kPiecesPerPart = 4;

// FNV-1a of a byte string; never 0 (0 means "no signature").
uint64_t hashText(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (char c : text) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ULL;
  }
  return h == 0 ? 1 : h;
}

// "all_reduce #7 (count 100, float32, SUM, one_shot)", plus the caller's signature if any.
std::string describe(const shm::OpDesc& d, std::string_view signature) {
  std::string s = std::string(collectiveName(static_cast<CollectiveKind>(d.kind))) + " #" +
                  std::to_string(d.seq) + " (count " + std::to_string(d.count) + ", " +
                  std::string(dataTypeName(static_cast<DataType>(d.type)));
  const auto kind = static_cast<CollectiveKind>(d.kind);
  if (reduces(kind)) {
    s += ", " + std::string(reduceKindName(static_cast<ReduceKind>(d.reduce)));
    if (static_cast<ReduceKind>(d.reduce) == ReduceKind::kPremulSum) {
      s += " x" + std::to_string(d.factor);
    }
  }
  if (hasRoot(kind)) {
    s += ", root " + std::to_string(d.root);
  }
  if (d.countsHash == kUnevenAllToAllHash) {
    s += ", split sizes of each rank's own";
  } else if (d.countsHash != 0) {
    s += ", per-rank counts #" + std::to_string(d.countsHash % 100000);
  }
  if (d.algorithm != 0) s += ", " + std::string(algorithmName(static_cast<Algorithm>(d.algorithm)));
  if (d.peerReadFrom != 0 || d.peerReadBelow != 0) {
    s += " from LOOM_PEER_READ_BYTES " + std::to_string(d.peerReadFrom) +
         " below LOOM_PEER_READ_MAX_BYTES " + std::to_string(d.peerReadBelow);
  }
  if (d.signatureHash != 0) s += ", " + std::string(signature);
  return s + ")";
}

void plainCopy(void* dst, const void* src, size_t n) {
  std::memcpy(dst, src, n);
}

// Calls move(task, lo, hi) for bytes [lo, hi) of every task, the tasks laid end to end and
// cut into `parts` slices of `total` bytes, one per helper thread (one part: on this thread).
template <class Task, class Move>
void spreadOver(std::span<const Task> tasks, size_t total, int parts, const Move& move) {
  if (parts == 1) {
    for (const Task& t : tasks) {
      if (t.bytes != 0) move(t, 0, t.bytes);
    }
    return;
  }
  const int pieces = parts * kPiecesPerPart;
  HelperPool::instance().run(parts, pieces, [&](int piece) {
    const auto [begin, end] = sliceOf(total, piece, pieces, 64);
    size_t offset = 0;
    for (const Task& t : tasks) {
      const size_t lo = std::max(begin, offset);
      const size_t hi = std::min(end, offset + t.bytes);
      if (lo < hi) move(t, lo - offset, hi - offset);
      offset += t.bytes;
      if (offset >= end) break;
    }
  });
}

// The fingerprint's top bit says whether the rank's process has lendable memory: not a field
// that must agree (ranks that differ in it fall back to comparing descriptors, which ignore it).
constexpr uint64_t kLendsBit = uint64_t{1} << 63;

// A hash of the fields that must agree, a word at a time (WordHash): every collective
// computes it on its way to posting, and a byte-wise hash's 48 dependent multiplies cost about
// 150 cycles there.
uint64_t fingerprintOf(const shm::OpDesc& d) {
  WordHash h;
  const auto mix = [&h](uint64_t v) { h.mix(v); };
  uint64_t factorBits;
  std::memcpy(&factorBits, &d.factor, sizeof factorBits);
  mix(d.seq);
  mix(d.count);
  mix(d.countsHash);
  mix(d.signatureHash);
  mix(d.peerReadFrom);
  mix(d.peerReadBelow);
  mix(factorBits);
  mix(uint64_t{d.kind} | uint64_t{d.type} << 8 | uint64_t{d.reduce} << 16 |
      uint64_t{d.algorithm} << 24 | static_cast<uint64_t>(static_cast<uint32_t>(d.root)) << 32);
  return h.value();
}

bool sameOp(const shm::OpDesc& a, const shm::OpDesc& b) {
  return a.seq == b.seq && a.kind == b.kind && a.type == b.type && a.reduce == b.reduce &&
         a.algorithm == b.algorithm && a.root == b.root && a.count == b.count &&
         a.countsHash == b.countsHash && a.signatureHash == b.signatureHash &&
         a.peerReadFrom == b.peerReadFrom && a.peerReadBelow == b.peerReadBelow &&
         std::memcmp(&a.factor, &b.factor, sizeof a.factor) == 0;
}

}  // namespace

uint64_t CollectiveContext::startPhase(bool writes) {
  const uint64_t p = ++phase_;
  if (opening_ == 0) {
    opening_ = p;
    open(p);
  } else if (writes) {
    const trace::Span span("slot wait", p);
    shm_.beginWrite(p, wait_);
  }
  return p;
}

void CollectiveContext::finishPhase(uint64_t p, Await await) {
  shm_.post(p);
  if (p != opening_ && await == Await::kNobody) return;
  const trace::Span span("phase wait", p);  // only where this rank waits
  if (p == opening_) return verifyAll(p);
  switch (await) {
    case Await::kNobody: return;
    case Await::kAll: return shm_.waitAll(p, wait_);
    case Await::kRoot: return shm_.waitPeer(args_->root, p, wait_);
  }
}

void CollectiveContext::open(uint64_t p) {
  const CollectiveArgs& args = *args_;
  shm_.beginWrite(p, wait_);
  mine_ = shm::OpDesc{};
  mine_.seq = seq_;
  mine_.count = args.count;
  mine_.countsHash = args.countsHash;
  mine_.factor = args.op.kind() == ReduceKind::kPremulSum ? args.op.factor() : 0.0;
  mine_.kind = static_cast<uint8_t>(args.kind);
  mine_.type = static_cast<uint8_t>(args.type);
  mine_.reduce = static_cast<uint8_t>(args.op.kind());
  mine_.algorithm = static_cast<uint8_t>(algorithm_);
  mine_.root = args.root;
  if (algorithm_ == Algorithm::kPeerRead) {
    mine_.peerReadFrom = tuning_.peerReadBytes;
    mine_.peerReadBelow = tuning_.peerReadMaxBytes;
  }
  signature_ = &args.signature;
  if (!args.signature.empty()) {
    // Desync debug: the text goes beside the descriptor so a mismatch can quote it; only
    // its hash takes part in the comparison.
    mine_.signatureHash = hashText(args.signature);
    char* text = shm_.signature(rank(), p).text;
    const size_t n = std::min(args.signature.size(), sizeof(shm::OpSignature::text) - 1);
    std::memcpy(text, args.signature.data(), n);
    text[n] = '\0';
  }
  shm_.desc(rank(), p) = mine_;
  if (algorithm_ == Algorithm::kPeerRead) {
    const shm::ReadProbe probe = shm::ownProbe();
    auto* words = reinterpret_cast<uint64_t*>(slot(rank(), p));
    words[0] = probe.address;
    words[1] = probe.token;
  }
  fingerprint_ = (fingerprintOf(mine_) & ~kLendsBit) |
                 (shm::LendingPool::instance().everLent() ? kLendsBit : 0);
  shm_.setFingerprint(p, fingerprint_);
}

void CollectiveContext::verifyAll(uint64_t p) {
  shm_.waitAll(p, wait_);
  bool everyRankLends = true;
  for (int q = 0; q < size(); ++q) {
    everyRankLends = everyRankLends && (shm_.fingerprint(q, p) & kLendsBit) != 0;
    // The fingerprint sits in the rank line the wait just read; the descriptor itself is
    // fetched only to describe a disagreement.
    if (q == rank() || shm_.fingerprint(q, p) == fingerprint_) continue;
    const shm::OpDesc& theirs = shm_.desc(q, p);
    if (sameOp(theirs, mine_)) continue;
    // Named as the communicator numbers them (a host's local indices differ where it spans
    // hosts).
    const int me = communicatorRank(rank());
    const int them = communicatorRank(q);
    const int low = std::min(them, me);
    const int high = std::max(them, me);
    const char* raw = shm_.signature(q, p).text;
    const std::string_view theirText(raw, ::strnlen(raw, sizeof(shm::OpSignature::text)));
    // Capped as the peer's is (its shared slot's size), so both fit in the failure record.
    const std::string_view myText =
        std::string_view(*signature_).substr(0, sizeof(shm::OpSignature::text) - 1);
    const bool iAmLow = low == me;
    failures_.fail(ErrorCode::kMismatch, them,
                   "ranks issued different collectives at the same step: rank " +
                       std::to_string(low) + " issued " +
                       describe(iAmLow ? mine_ : theirs, iAmLow ? myText : theirText) +
                       " but rank " + std::to_string(high) + " issued " +
                       describe(iAmLow ? theirs : mine_, iAmLow ? theirText : myText));
    throw failures_.failureError(collectiveName(static_cast<CollectiveKind>(mine_.kind)));
  }
  shm_.setEveryRankLends(everyRankLends);
}

std::vector<const uint8_t*> CollectiveContext::openLent(const void* input,
                                                        std::span<const size_t> bytes) {
  const int me = rank();
  const uint64_t p = startPhase(true);
  std::optional<shm::LentBuffer> lent;
  if (input != nullptr && bytes[me] != 0) {
    lent = shm::LendingPool::instance().find(input, bytes[me]);
  }
  shm::LentBuffer& line = shm_.lent(me, p);
  if (lent) {
    line = *lent;
  } else {
    line.fd = -1;
  }
  finishPhase(p, Await::kAll);
  std::vector<const uint8_t*> inputs(static_cast<size_t>(size()));
  for (int q = 0; q < size(); ++q) {
    if (shm_.lent(q, p).fd < 0) return {};  // every rank sees the same lines
  }
  // Each rank maps what it reads (kept for later calls); whether all could is agreed in a
  // phase of its own, since a rank in another pid namespace, say, cannot.
  shm_.dropClosedLent();
  bool mapped = true;
  for (int q = 0; q < size(); ++q) {
    const shm::LentBuffer& theirs = shm_.lent(q, p);
    if (q == me) {
      inputs[q] = static_cast<const uint8_t*>(input);
    } else if (theirs.bytes >= bytes[q]) {
      inputs[q] = shm_.mapLent(q, theirs);
      mapped = mapped && inputs[q] != nullptr;
    } else {
      mapped = false;  // the rank lent less than this rank must read: stage instead
    }
  }
  const uint64_t agree = startPhase(true);
  *slot(me, agree) = mapped ? 1 : 0;
  finishPhase(agree, Await::kAll);
  for (int q = 0; q < size(); ++q) {
    if (*slot(q, agree) == 0) return {};
  }
  shm::countLentCollective();
  return inputs;
}

void CollectiveContext::closeReads() {
  const uint64_t p = startPhase(false);
  finishPhase(p, Await::kAll);
  // Every peer posted this phase, but one may have posted it and then left its call early,
  // failing the communicator (its deadline, an abort, a failure from elsewhere): its caller
  // may have rewritten the input this rank was still reading. A rank that leaves early
  // records the failure first, so one not seen here, after this rank's reads, means no
  // peer left before they were done.
  if (failures_.failed()) throw failures_.failureError(collectiveName(args_->kind));
}

bool CollectiveContext::peersReadable(uint64_t p) {
  using State = shm::ShmComm::PeerReads;
  if (shm_.peerReads() == State::kUnknown) {
    bool readable = true;
    for (int q = 0; q < size() && readable; ++q) {
      if (q == rank()) continue;
      const auto* words = reinterpret_cast<const uint64_t*>(slot(q, p));
      readable = shm::canReadFrom(shm_.pidOf(q), shm::ReadProbe{words[0], words[1]});
    }
    // A phase of its own, so every rank learns whether all could; the opening's words are
    // no longer read (posting it says so), and no later phase of a peer-read collective
    // writes a slot.
    const uint64_t agree = startPhase(true);
    *slot(rank(), agree) = readable ? 1 : 0;
    finishPhase(agree, Await::kAll);
    bool all = true;
    for (int q = 0; q < size(); ++q) all = all && *slot(q, agree) == 1;
    shm_.setPeerReads(all ? State::kYes : State::kNo);
  }
  if (shm_.peerReads() != State::kYes) return false;
  shm::countPeerReadCollective();
  return true;
}

void CollectiveContext::peerReadFailed(int q, int error) {
  const int me = communicatorRank(rank());
  const int them = communicatorRank(q);
  // No such process: the peer is gone mid-collective. Marked dead (unless it had departed)
  // and reported as any wait on it would report it.
  if (error == ESRCH) {
    shm_.markDead(q);
    failures_.peerGone(them, shm_.stateOf(q), wait_);
  }
  const std::string op(collectiveName(args_->kind));
  failures_.fail(ErrorCode::kSystem, them,
                 op + ": rank " + std::to_string(me) + " could not read rank " +
                     std::to_string(them) + "'s buffer (process_vm_readv: " + std::strerror(error) +
                     "); set LOOM_PEER_READS=0 on every rank to stage collectives through "
                     "shared memory instead");
  throw failures_.failureError(op);
}

void CollectiveContext::readPeers(std::span<const PeerCopy> tasks) {
  size_t total = 0;
  for (const PeerCopy& t : tasks) total += t.bytes;
  const trace::Span span("peer read", total);
  // The first read refused, by any part: (peer, errno).
  std::atomic<int> failedPeer{-1};
  std::atomic<int> failedErrno{0};
  auto move = [&](const PeerCopy& t, size_t lo, size_t hi) {
    auto* dst = static_cast<uint8_t*>(t.dst) + lo;
    const auto* src = static_cast<const uint8_t*>(t.src) + lo;
    if (t.peer == rank()) {
      if (dst != src) std::memcpy(dst, src, hi - lo);
      return;
    }
    const int error = shm::readFrom(shm_.pidOf(t.peer), dst, src, hi - lo);
    int none = -1;
    if (error != 0 && failedPeer.compare_exchange_strong(none, t.peer)) failedErrno = error;
  };
  spreadOver(tasks, total, partsFor(total), move);
  if (failedPeer.load() >= 0) peerReadFailed(failedPeer.load(), failedErrno.load());
}

size_t regionElements(const CollectiveContext& ctx, DataType type) {
  const size_t align = lineElements(type);
  const size_t perRank = ctx.chunkBytes() / elementSize(type) / static_cast<size_t>(ctx.size());
  return std::max(align, perRank / align * align);
}

int CollectiveContext::partsFor(size_t bytes) const {
  const size_t parts = bytes / kMinBytesPerPart;
  if (parts <= 1) return 1;
  return static_cast<int>(std::min<size_t>(parts, static_cast<size_t>(tuning_.threads)));
}

void CollectiveContext::copy(std::span<const CopyTask> tasks, bool streaming) {
  using Move = void (*)(void*, const void*, size_t);
  const Move move = streaming ? &kernels::copyStreaming : &plainCopy;
  size_t total = 0;
  for (const CopyTask& t : tasks) total += t.bytes;
  const trace::Span span("copy", total);
  spreadOver(tasks, total, partsFor(total), [move](const CopyTask& t, size_t lo, size_t hi) {
    if (t.dst == t.src) return;  // in place
    move(static_cast<uint8_t*>(t.dst) + lo, static_cast<const uint8_t*>(t.src) + lo, hi - lo);
  });
}

void CollectiveContext::reduce(void* dst, std::span<const void* const> srcs, size_t count,
                               const kernels::ReduceSpec& spec) {
  const size_t esize = elementSize(spec.type);
  const trace::Span span("reduction", count * esize);
  const int parts = partsFor(count * esize * srcs.size());
  const int nsrc = static_cast<int>(srcs.size());
  if (parts == 1) {
    kernels::reduce(dst, srcs.data(), nsrc, count, spec);
    return;
  }
  const int pieces = parts * kPiecesPerPart;
  HelperPool::instance().run(parts, pieces, [&](int piece) {
    const auto [begin, end] = sliceOf(count, piece, pieces, lineElements(spec.type));
    if (begin == end) return;
    kernels::SourcesAt sources(srcs.data(), nsrc);
    kernels::reduce(static_cast<uint8_t*>(dst) + begin * esize, sources.at(begin * esize), nsrc,
                    end - begin, spec);
  });
}

void runCollective(CollectiveContext& ctx, const CollectiveArgs& args) {
  const size_t bytes = args.count * elementSize(args.type);
  Algorithm algorithm{};  // all_reduce and reduce by size; all_gather, reduce_scatter: lent
  if (args.kind == CollectiveKind::kAllReduce) algorithm = ctx.selection().allReduce(bytes);
  if (args.kind == CollectiveKind::kReduce) algorithm = ctx.selection().reduce(bytes);
  if (args.kind == CollectiveKind::kAllGather || args.kind == CollectiveKind::kReduceScatter) {
    // The whole of the per-rank blocks (the all_gather's output, the reduce_scatter's
    // input): `count` is one block, or their sum in the V variants.
    const size_t whole = args.variable ? bytes : bytes * static_cast<size_t>(ctx.size());
    // Decided from the last opening (so every rank decides alike): a job in which some
    // process never lends pays nothing for the lent path.
    if (ctx.lendsAt(whole) && ctx.everyRankLends()) algorithm = Algorithm::kLent;
  }
  if (args.kind == CollectiveKind::kAllToAll) {
    // Only all_to_all reads peers: each rank reads pages no other rank reads. An all_gather
    // (every rank pinning the same pages at once) took at least 1.7x as long as staging
    // at 16 ranks, and a reduce_scatter gained less than its run-to-run spread
    // (docs/PERFORMANCE.md, "Peer reads"). Per-pair counts are local until the opening
    // publishes them: those calls read peers if the largest exchange turns out large enough
    // (all_to_all.cc), so they pick the path that can.
    const size_t whole = bytes * static_cast<size_t>(ctx.size());
    if (args.variable ? ctx.peerReadsPossible() : ctx.peerReadsAt(whole)) {
      algorithm = Algorithm::kPeerRead;
    }
  }
  // The choice travels in the opening descriptor: ranks whose tables differ get a mismatch.
  ctx.begin(args, algorithm);
  const bool oneShot = algorithm == Algorithm::kOneShot;
  switch (args.kind) {
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kReduce: {
      const bool receives = args.kind == CollectiveKind::kAllReduce || ctx.rank() == args.root;
      return oneShot ? reduceOneShot(ctx, args, receives) : reduceTwoShot(ctx, args, receives);
    }
    case CollectiveKind::kBroadcast: return broadcast(ctx, args);
    case CollectiveKind::kAllGather: return allGather(ctx, args);
    case CollectiveKind::kReduceScatter: return reduceScatter(ctx, args);
    case CollectiveKind::kAllToAll: return allToAll(ctx, args);
    case CollectiveKind::kGather: return gather(ctx, args);
    case CollectiveKind::kScatter: return scatter(ctx, args);
    case CollectiveKind::kBarrier: return barrier(ctx, args);
  }
}

}  // namespace loom
