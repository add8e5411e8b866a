#pragma once

// Inter-host steps among a rail: one rank on each host (the ranks of one local index), each
// holding a buffer cut into one block per member. These are the network halves of the
// hierarchical collectives (hierarchical.cc).
//
// Two patterns move the blocks:
// - a ring (member i sends to i + 1): 2(n - 1) steps for an all_reduce, each member sending
//   and receiving one block per step, always to the same neighbours;
// - recursive halving and doubling: 2 log2(n) steps, halving the bytes each step; for n not
//   a power of two, the first 2r members (r = n - 2^k) fold pairwise first (the even member
//   hands its data to the odd one and gets its result back at the end).
// Both move the bandwidth-optimal (n - 1)/n of the buffer per member and direction for a
// reduce-scatter or an all-gather (plus the fold's extra buffer for folded pairs). Small
// all_reduces use recursive doubling (log2 n steps of the whole buffer).
//
// Every element is reduced by exactly one member in one fixed order and then copied (ring,
// halving), or by both partners of each step with the lower member's operand first
// (doubling), so every member ends with the same bits.

#include <cstddef>
#include <vector>

#include "algorithms/across_hosts.h"

namespace loom {

/// The members of a rail (communicator ranks, one per host, in the order of their blocks)
/// and this rank's position among them.
struct Rail {
  std::vector<int> members;
  int position = 0;
  int size() const { return static_cast<int>(members.size()); }
  /// The same members, numbered from `first`: position i becomes (i - first) mod n.
  Rail rotated(int first) const;
};

/// Block i of a rail's buffer is elements [bounds[i], bounds[i + 1]); bounds has one entry
/// more than the rail has members.
using Bounds = std::vector<size_t>;

/// Element bounds of `parts` slices of `count` elements of `type`, cut at cache lines.
Bounds evenBounds(size_t count, int parts, DataType type);

/// How a rail moves blocks for reduce-scatters and all-gathers.
enum class RailPattern : uint8_t { kRing, kHalving };

/// The pattern for a rail of `members` whose largest block is `blockBytes`: the ring for up
/// to 3 members, and for up to 15 whose blocks make every step bandwidth-bound; else halving
/// and doubling for powers of two, and from 16 on (where the fold costs less than a long
/// ring's latency); else the ring.
RailPattern railPatternFor(int members, size_t blockBytes);

/// How a rail broadcasts: down a binomial tree in whole, down a pipelined chain in pieces,
/// or as a binomial scatter and then an all-gather.
enum class BroadcastPattern : uint8_t { kTree, kChain, kScatterAllGather };

/// The pattern for a rail of `members` broadcasting `bytes`: the tree for two members and up
/// to 256 KiB, the chain where it has enough pieces to fill (4 (n - 2) of 128 KiB, or of at
/// least 16 KiB; at most 32), else the scatter and all-gather.
BroadcastPattern broadcastPatternFor(int members, size_t bytes);

/// After this, member i holds block i reduced over every member (its other blocks hold
/// partial sums).
void railReduceScatter(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data,
                       const Bounds& bounds, DataType type, ReduceOp op);
/// Member i holds block i; after this every member holds every block.
void railAllGather(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data, const Bounds& bounds,
                   DataType type);
/// Every member's `count` elements at `data` reduced over the rail, on every member.
void railAllReduce(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data, size_t count,
                   DataType type, ReduceOp op);
/// Between two members an all_reduce is one exchange of the whole buffer and one reduction;
/// these are its two halves, for a caller that overlaps the reduction with later network
/// steps (railAllReduce of two members runs one, then the other). The exchange sends `bytes`
/// at `data` and receives the other member's buffer into `incoming`; the finish reduces it
/// into `data` with the lower position's operand first, so both members hold the same bits.
void pairAllReduceExchange(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data,
                           uint8_t* incoming, size_t bytes);
void pairAllReduceFinish(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data,
                         const uint8_t* incoming, size_t count, DataType type, ReduceOp op);
/// The `count` elements at `data` of the member at `root` (a position) to every member.
void railBroadcast(AcrossHostsContext& ctx, const Rail& rail, uint8_t* data, size_t count,
                   DataType type, int root);

}  // namespace loom
