// all_to_all (equal or per-pair counts): the same per-destination regions as
// reduce_scatter; per chunk every rank fills region q with the next part of its block for
// rank q (q not itself), posts and waits for all, then copies region `rank` of every other
// slot out, and its block for itself straight from its input.
//
// The V variant first runs a short phase in which every rank publishes its send counts:
// each rank checks them against its receive counts (a mismatch is an error naming both
// ranks, not a corrupted buffer) and all agree on how many chunks the largest block needs.
//
// Reading peers (Algorithm::kPeerRead): the opening carries every rank's block addresses
// (and, in the V variant, its send counts); each rank then copies its block out of every
// peer's process straight into its output, and a last phase keeps every rank until its
// peers are done reading it. If any rank runs in place, all stage instead.

#include <cstring>

#include "algorithms/collective.h"

namespace loom {

namespace {

bool overlaps(const CollectiveArgs& args, size_t es) {
  for (size_t i = 0; i < args.inputs.size(); ++i) {
    for (size_t o = 0; o < args.outputs.size(); ++o) {
      if (rangesOverlap(args.inputs[i], args.inputCounts[i] * es, args.outputs[o],
                        args.outputCounts[o] * es)) {
        return true;
      }
    }
  }
  return false;
}

// Rank q's words in opening p: its send counts (V variant), then, when reading peers, its
// block addresses.
uint64_t* wordsOf(const CollectiveContext& ctx, int q, uint64_t p) {
  return ctx.readsPeers() ? ctx.peerWords(q, p) : reinterpret_cast<uint64_t*>(ctx.slot(q, p));
}

// Checks every rank's send counts published in opening p against this rank's receive counts
// and returns the largest count any pair uses.
size_t checkCounts(CollectiveContext& ctx, const CollectiveArgs& args, uint64_t p) {
  const int me = ctx.rank();
  const int size = ctx.size();
  size_t longest = 0;
  for (int q = 0; q < size; ++q) {
    const uint64_t* theirs = wordsOf(ctx, q, p);
    if (theirs[me] != args.outputCounts[q]) {
      // Named as the communicator numbers them (across hosts this is a local step).
      const int sender = ctx.communicatorRank(q);
      ctx.failures().fail(ErrorCode::kMismatch, sender,
                          "all_to_all: rank " + std::to_string(sender) + " sends " +
                              std::to_string(theirs[me]) + " elements to rank " +
                              std::to_string(ctx.communicatorRank(me)) + ", which expects " +
                              std::to_string(args.outputCounts[q]) +
                              " from it; input and output split sizes must match pairwise");
      throw ctx.failures().failureError("all_to_all");
    }
    for (int r = 0; r < size; ++r) longest = std::max<size_t>(longest, theirs[r]);
  }
  return longest;
}

// The most bytes any rank receives, from the counts published in opening p.
size_t largestExchange(const CollectiveContext& ctx, const CollectiveArgs& args, uint64_t p) {
  size_t largest = 0;
  for (int r = 0; r < ctx.size(); ++r) {
    size_t received = 0;
    for (int q = 0; q < ctx.size(); ++q) received += wordsOf(ctx, q, p)[r];
    largest = std::max(largest, received);
  }
  return largest * elementSize(args.type);
}

}  // namespace

void allToAll(CollectiveContext& ctx, const CollectiveArgs& original) {
  const size_t es = elementSize(original.type);
  const size_t region = regionElements(ctx, original.type);
  const int me = ctx.rank();
  const int size = ctx.size();
  // Blocks of one rank that overlap (in place with uneven splits) would be overwritten
  // before they are sent: stage the input first.
  CollectiveArgs args = original;
  std::vector<uint8_t> staged;
  if (args.variable && overlaps(args, es)) {
    size_t total = 0;
    for (size_t n : args.inputCounts) total += n;
    staged.resize(total * es);
    size_t offset = 0;
    for (int q = 0; q < size; ++q) {
      std::memcpy(staged.data() + offset, args.inputs[q], args.inputCounts[q] * es);
      args.inputs[q] = staged.data() + offset;
      offset += args.inputCounts[q] * es;
    }
  }
  size_t longest = args.count;
  // The V variant and the peer-read path open with words of their own: send counts, then
  // block addresses and whether the rank's output overlaps its input.
  const bool opened = args.variable || ctx.readsPeers();
  if (opened) {
    const uint64_t p = ctx.startPhase(true);  // the opening phase
    uint64_t* mine = wordsOf(ctx, me, p);
    const int addresses = args.variable ? size : 0;  // where the addresses start
    const int inPlace = addresses + size;
    for (int q = 0; q < size; ++q) {
      if (args.variable) mine[q] = args.inputCounts[q];
      if (ctx.readsPeers()) mine[addresses + q] = reinterpret_cast<uint64_t>(args.inputs[q]);
    }
    if (ctx.readsPeers()) mine[inPlace] = overlaps(args, es) ? 1 : 0;
    ctx.finishPhase(p, CollectiveContext::Await::kAll);
    if (args.variable) longest = checkCounts(ctx, args, p);
    if (args.variable && longest == 0) {
      // Nothing moves anywhere, so no phase follows in which the ranks would meet: one more
      // meeting, so that a rank that expected data and refused above fails the others in this
      // call, not their next one (every rank read the same counts, so all take it).
      const uint64_t meet = ctx.startPhase(false);
      ctx.finishPhase(meet, CollectiveContext::Await::kAll);
      // Then nothing is left to do, and every rank, having read the same counts, ends here:
      // before it reads the opening's words again, which a faster rank's next phase (the
      // opening's half, in this call or its next) may be rewriting by now.
      return;
    }
    // Peers would read blocks that a rank in place overwrites as it receives: setting its
    // input aside first cost more than staging (0.26-0.67x, docs/PERFORMANCE.md), so then
    // every rank stages.
    auto inPlaceAnywhere = [&] {
      for (int q = 0; q < size; ++q) {
        if (ctx.peerWords(q, p)[inPlace] != 0) return true;
      }
      return false;
    };
    if (ctx.readsPeers() && !inPlaceAnywhere() &&
        (!args.variable || ctx.peerReadsAt(largestExchange(ctx, args, p)))) {
      // Each rank starts with the next rank up, so the ranks read different processes at
      // any moment rather than all reading rank 0 first.
      std::vector<CollectiveContext::PeerCopy> reads;
      for (int k = 0; k < size; ++k) {
        const int q = (me + k) % size;
        const auto* theirs = reinterpret_cast<const void*>(ctx.peerWords(q, p)[addresses + me]);
        reads.push_back(
            {args.outputs[q], q, q == me ? args.inputs[me] : theirs, args.outputCounts[q] * es});
      }
      if (ctx.peersReadable(p)) {
        ctx.readPeers(reads);
        return ctx.closeReads();
      }
    }
  }
  auto part = [&](const std::vector<size_t>& counts, int q, size_t begin) {
    return begin >= counts[q] ? size_t{0} : std::min(region, counts[q] - begin);
  };
  // This rank's block for itself goes straight from input to output, without the slot,
  // unless an output block overlaps it (other than itself, in place): then the slot's copy
  // keeps it safe from those writes.
  bool ownFromInput = true;
  for (int q = 0; q < size; ++q) {
    const bool same = q == me && args.outputs[q] == args.inputs[me];
    if (!same && rangesOverlap(args.outputs[q], args.outputCounts[q] * es, args.inputs[me],
                               args.inputCounts[me] * es)) {
      ownFromInput = false;
    }
  }
  PerRank<CopyTask> tasks(static_cast<size_t>(size));
  size_t received = 0;
  for (size_t n : args.outputCounts) received += n;
  const bool stream = ctx.streams(received * es);
  // An opening that published words may be the only phase.
  const size_t chunks = opened ? (longest + region - 1) / region : chunksOf(longest, region);
  for (size_t c = 0; c < chunks; ++c) {
    const size_t begin = c * region;
    const uint64_t p = ctx.startPhase(true);
    uint8_t* mine = ctx.slot(me, p);
    for (int q = 0; q < size; ++q) {
      const size_t bytes = q == me && ownFromInput ? 0 : part(args.inputCounts, q, begin) * es;
      tasks[q] = {mine + q * region * es, static_cast<const uint8_t*>(args.inputs[q]) + begin * es,
                  bytes};
    }
    ctx.copy(tasks);
    ctx.finishPhase(p, CollectiveContext::Await::kAll);
    for (int q = 0; q < size; ++q) {
      const uint8_t* from = q == me && ownFromInput
                                ? static_cast<const uint8_t*>(args.inputs[me]) + begin * es
                                : ctx.slot(q, p) + me * region * es;
      tasks[q] = {static_cast<uint8_t*>(args.outputs[q]) + begin * es, from,
                  part(args.outputCounts, q, begin) * es};
    }
    ctx.copy(tasks, stream);
  }
}

}  // namespace loom
