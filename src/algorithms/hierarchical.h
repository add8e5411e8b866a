#pragma once

// The hierarchical collectives across hosts: local steps over each host's segment around
// inter-host steps on the rails (rail.h). R, the number of rails, is the fewest ranks any
// host has (one rail for small buffers); the ranks of local index s < R on every host form
// rail s and carry 1/R of the bytes between hosts.
//
// Each host's ranks lay their blocks end to end in rank order, the host's "range"; its
// piece s (a 1/R slice of the range) is what rail s carries for that host:
// - all_reduce: local reduce-scatter to the rail ranks, all_reduce along each rail, local
//   all-gather.
// - all_gather: local all-gather of the host's blocks; rail s all-gathers piece s of every
//   host; a local all-gather of what the rails received.
// - reduce_scatter: local reduce-scatter of each rail's pieces (of every host) to its rail
//   rank; rail s reduce-scatters them across hosts, so each host's rail s holds its own
//   piece s reduced over all ranks; a local all-to-all hands each rank its block.
// - broadcast: local broadcast on the root's host; rail s broadcasts slice s from there;
//   local all-gather of the slices on every other host.
// AVG sums everywhere and divides once, on the rank that finishes each element; PREMUL_SUM
// scales within the host and sums across.

#include "algorithms/across_hosts.h"

namespace loom {

void allReduceAcrossHosts(AcrossHostsContext& ctx, const void* input, void* output, size_t count,
                          DataType type, ReduceOp op, uint64_t countsHash = 0);
void allGatherAcrossHosts(AcrossHostsContext& ctx, const void* input,
                          const std::vector<void*>& outputs, const std::vector<size_t>& counts,
                          DataType type, uint64_t countsHash);
void reduceScatterAcrossHosts(AcrossHostsContext& ctx, const std::vector<const void*>& inputs,
                              const std::vector<size_t>& counts, void* output, DataType type,
                              ReduceOp op, uint64_t countsHash);
void broadcastAcrossHosts(AcrossHostsContext& ctx, const void* input, void* output, size_t count,
                          DataType type, int root);

}  // namespace loom
