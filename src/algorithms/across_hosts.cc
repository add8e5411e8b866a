// Collectives across hosts: the context's memory operations, direct all_to_all, the
// collectives derived from the hierarchical ones, and the dispatch.

#include "algorithms/across_hosts.h"

#include <algorithm>
#include <cstring>

#include "algorithms/hierarchical.h"
#include "loom/error.h"

namespace loom {

HostLayout HostLayout::of(std::vector<std::vector<int>> ranksOn, int rank) {
  HostLayout layout;
  layout.rank = rank;
  layout.rails = INT32_MAX;
  for (int h = 0; h < static_cast<int>(ranksOn.size()); ++h) {
    const auto& ranks = ranksOn[h];
    const auto it = std::find(ranks.begin(), ranks.end(), rank);
    if (it != ranks.end()) {
      layout.host = h;
      layout.localIndex = static_cast<int>(it - ranks.begin());
    }
    layout.size += static_cast<int>(ranks.size());
    layout.rails = std::min(layout.rails, static_cast<int>(ranks.size()));
  }
  layout.ranksOn = std::move(ranksOn);
  return layout;
}

uint8_t* ScratchArena::take(size_t bytes) {
  if (used_ == buffers_.size()) buffers_.emplace_back();
  std::vector<uint8_t>& buffer = buffers_[used_++];
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

void AcrossHostsContext::reduce(void* dst, std::span<const void* const> srcs, size_t count,
                                const kernels::ReduceSpec& spec) {
  if (count != 0) kernels::reduce(dst, srcs.data(), static_cast<int>(srcs.size()), count, spec);
}

void AcrossHostsContext::copy(void* dst, const void* src, size_t bytes) {
  if (bytes != 0 && dst != src) std::memcpy(dst, src, bytes);
}

void AcrossHostsContext::zero(void* dst, size_t bytes) {
  if (bytes != 0) std::memset(dst, 0, bytes);
}

namespace {

template <class To, class From>
void convertAs(void* dst, const void* src, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    static_cast<To*>(dst)[i] = static_cast<To>(static_cast<const From*>(src)[i]);
  }
}

template <class To>
void convertTo(void* dst, const void* src, DataType from, size_t count) {
  switch (from) {
    case DataType::kInt8: return convertAs<To, int8_t>(dst, src, count);
    case DataType::kUInt8: return convertAs<To, uint8_t>(dst, src, count);
    case DataType::kInt16: return convertAs<To, int16_t>(dst, src, count);
    case DataType::kInt32: return convertAs<To, int32_t>(dst, src, count);
    case DataType::kInt64: return convertAs<To, int64_t>(dst, src, count);
    default: throw Error(ErrorCode::kInternal, "convert", -1, "not an integer type");
  }
}

}  // namespace

void AcrossHostsContext::convert(void* dst, DataType to, const void* src, DataType from,
                                 size_t count) {
  switch (to) {
    case DataType::kInt8: return convertTo<int8_t>(dst, src, from, count);
    case DataType::kUInt8: return convertTo<uint8_t>(dst, src, from, count);
    case DataType::kInt16: return convertTo<int16_t>(dst, src, from, count);
    case DataType::kInt32: return convertTo<int32_t>(dst, src, from, count);
    case DataType::kInt64: return convertTo<int64_t>(dst, src, from, count);
    default: throw Error(ErrorCode::kInternal, "convert", -1, "not an integer type");
  }
}

uint8_t* AcrossHostsContext::scratch(size_t bytes) {
  return arena_.take(bytes);
}

size_t AcrossHostsContext::startRail(RailSteps steps) {
  std::exception_ptr outcome;
  try {
    steps(*this);
  } catch (...) {
    outcome = std::current_exception();
  }
  ranHere_.push_back(outcome);
  return ranHere_.size() - 1;
}

void AcrossHostsContext::finishRail(size_t ticket) {
  if (ranHere_.at(ticket)) std::rethrow_exception(ranHere_[ticket]);
}

namespace {

bool overlap(const void* a, size_t aBytes, const void* b, size_t bBytes) {
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  return x < y + bBytes && y < x + aBytes;
}

// Blocks for this host's ranks go through the segment; blocks for the others go directly
// over the network, all at once. Where an output overlaps a block still to be sent (an
// all_to_all in place), the blocks for other hosts are copied aside first: a receive would
// otherwise overwrite them while they are going out.
void allToAllAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  const HostLayout& L = ctx.layout();
  const size_t es = elementSize(args.type);
  const std::vector<int>& here = L.ranksOn[L.host];
  auto isLocal = [&](int q) { return std::find(here.begin(), here.end(), q) != here.end(); };
  std::vector<const void*> sources = args.inputs;
  bool aside = false;
  for (int q = 0; q < L.size && !aside; ++q) {
    if (isLocal(q)) continue;
    for (int o = 0; o < L.size && !aside; ++o) {
      aside = overlap(args.inputs[q], args.inputCounts[q] * es, args.outputs[o],
                      args.outputCounts[o] * es);
    }
  }
  if (aside) {
    for (int q = 0; q < L.size; ++q) {
      if (isLocal(q)) continue;
      uint8_t* copy = ctx.scratch(args.inputCounts[q] * es);
      ctx.copy(copy, args.inputs[q], args.inputCounts[q] * es);
      sources[q] = copy;
    }
  }
  auto local = CollectiveArgs::of(CollectiveKind::kAllToAll, args.type, ReduceOp(), 0, args.count,
                                  nullptr, nullptr);
  local.variable = args.variable;
  for (int q : here) {
    local.inputs.push_back(args.inputs[q]);
    local.inputCounts.push_back(args.inputCounts[q]);
    local.outputs.push_back(args.outputs[q]);
    local.outputCounts.push_back(args.outputCounts[q]);
  }
  ctx.runLocal(local);
  std::vector<NetTransfer> sends, receives;
  for (int q = 0; q < L.size; ++q) {
    if (isLocal(q)) continue;
    sends.push_back({q, const_cast<void*>(sources[q]), args.inputCounts[q] * es, 0});
    receives.push_back({q, args.outputs[q], args.outputCounts[q] * es, 0});
  }
  ctx.exchange(sends, receives);
}

// An all_to_all of equal blocks up to this many bytes per rank goes through carriers: a
// message per host pair and rail instead of one per pair of ranks, so its latency is two
// local steps and one network step whatever the number of ranks. Measured on the 16-core
// host, 8 B to 32 KiB per rank: 31-49 µs against 104-114 µs direct across 2 namespace
// hosts x 4 ranks, 78-100 against 142-312 µs across 4 x 2.
constexpr size_t kCarriedAllToAllBytes = size_t{128} << 10;

// Small all_to_all of equal blocks through carriers. Rail rank s of each host carries the
// blocks of its host's sources j with j mod R = s: (1) a local all_to_all hands each carrier
// its sources' blocks for other hosts (beside every rank's blocks for this host); (2) each
// carrier sends every other host one message (its sources' blocks for that host's ranks) to
// the same rail's rank there; (3) a local all_to_all hands each rank the blocks the carriers
// received for it.
void carriedAllToAll(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  const HostLayout& L = ctx.layout();
  const int R = L.rails;
  const int me = L.localIndex;
  const int A = L.host;
  const std::vector<int>& here = L.ranksOn[A];
  const size_t b = args.count * elementSize(args.type);               // bytes per block
  const size_t remote = static_cast<size_t>(L.size - L.localSize());  // ranks elsewhere
  auto sources = [&](int host, int s) {  // local indices of host's ranks that rail s carries
    std::vector<int> js;
    for (int j = s; j < static_cast<int>(L.ranksOn[host].size()); j += R) js.push_back(j);
    return js;
  };
  auto blocksFor = [&](int host, int s) { return sources(host, s).size(); };
  const int carrier = me % R;

  // This rank's blocks for other hosts, in host order: what its carrier forwards.
  uint8_t* outbound = ctx.scratch(remote * b);
  size_t at = 0;
  for (int B = 0; B < L.hosts(); ++B) {
    if (B == A) continue;
    for (int q : L.ranksOn[B]) ctx.copy(outbound + at++ * b, args.inputs[q], b);
  }

  // 1. Within the host: every rank's block for each rank here, and to its carrier (when it
  //    is not its own) its blocks for other hosts, behind that block.
  const auto n = static_cast<size_t>(L.localSize());
  CollectiveArgs step1 =
      CollectiveArgs::of(CollectiveKind::kAllToAll, args.type, ReduceOp(), 0, 0, nullptr, nullptr);
  step1.variable = true;
  uint8_t* toCarrier = nullptr;
  if (carrier != me) {
    toCarrier = ctx.scratch(b + remote * b);
    ctx.copy(toCarrier, args.inputs[here[carrier]], b);
    ctx.copy(toCarrier + b, outbound, remote * b);
  }
  std::vector<uint8_t*> fromSource(n, nullptr);  // sources this rank carries, whole
  for (size_t t = 0; t < n; ++t) {
    const bool carried = static_cast<int>(t) == carrier && carrier != me;
    step1.inputs.push_back(carried ? toCarrier : args.inputs[here[t]]);
    step1.inputCounts.push_back((carried ? b + remote * b : b) / elementSize(args.type));
    const bool carries = static_cast<int>(t) % R == me && static_cast<int>(t) != me;
    if (carries) fromSource[t] = ctx.scratch(b + remote * b);
    step1.outputs.push_back(carries ? fromSource[t] : args.outputs[here[t]]);
    step1.outputCounts.push_back((carries ? b + remote * b : b) / elementSize(args.type));
  }
  ctx.runLocal(step1);
  for (size_t t = 0; t < n; ++t) {
    if (fromSource[t]) ctx.copy(args.outputs[here[t]], fromSource[t], b);
  }

  // 2. Carriers: one message to the same rail's rank on every other host.
  std::vector<NetTransfer> sends, receives;
  std::vector<uint8_t*> arrived(static_cast<size_t>(L.hosts()), nullptr);
  if (me < R) {
    const std::vector<int> mine = sources(A, me);
    size_t offset = 0;  // of host B's ranks among the ranks elsewhere
    for (int B = 0; B < L.hosts(); ++B) {
      if (B == A) continue;
      const size_t lb = L.ranksOn[B].size();
      uint8_t* message = ctx.scratch(mine.size() * lb * b);
      for (size_t i = 0; i < mine.size(); ++i) {
        const uint8_t* from = mine[i] == me ? outbound : fromSource[mine[i]] + b;
        ctx.copy(message + i * lb * b, from + offset * b, lb * b);
      }
      sends.push_back({L.ranksOn[B][me], message, mine.size() * lb * b, 0});
      arrived[B] = ctx.scratch(blocksFor(B, me) * n * b);
      receives.push_back({L.ranksOn[B][me], arrived[B], blocksFor(B, me) * n * b, 0});
      offset += lb;
    }
  }
  ctx.exchange(sends, receives);

  // 3. Within the host: each carrier hands each rank what came for it.
  CollectiveArgs step3 =
      CollectiveArgs::of(CollectiveKind::kAllToAll, args.type, ReduceOp(), 0, 0, nullptr, nullptr);
  step3.variable = true;
  size_t carried = 0;  // blocks this rank carries in from other hosts
  for (int B = 0; B < L.hosts(); ++B) {
    if (B != A && me < R) carried += blocksFor(B, me);
  }
  std::vector<uint8_t*> perRank(n, nullptr), fromCarrier(n, nullptr);
  for (size_t k = 0; k < n; ++k) {
    if (me < R) {
      perRank[k] = ctx.scratch(carried * b);
      size_t i = 0;
      for (int B = 0; B < L.hosts(); ++B) {
        if (B == A) continue;
        for (size_t x = 0; x < blocksFor(B, me); ++x) {
          ctx.copy(perRank[k] + i++ * b, arrived[B] + (x * n + k) * b, b);
        }
      }
    }
    step3.inputs.push_back(perRank[k] ? perRank[k] : outbound);
    step3.inputCounts.push_back((me < R ? carried * b : 0) / elementSize(args.type));
    size_t incoming = 0;  // blocks carrier k brings this rank
    for (int B = 0; B < L.hosts(); ++B) {
      if (B != A && static_cast<int>(k) < R) incoming += blocksFor(B, static_cast<int>(k));
    }
    fromCarrier[k] = ctx.scratch(incoming * b);
    step3.outputs.push_back(fromCarrier[k]);
    step3.outputCounts.push_back(incoming * b / elementSize(args.type));
  }
  ctx.runLocal(step3);
  for (int s = 0; s < R; ++s) {
    size_t i = 0;
    for (int B = 0; B < L.hosts(); ++B) {
      if (B == A) continue;
      for (int j : sources(B, s)) {
        ctx.copy(args.outputs[L.ranksOn[B][j]], fromCarrier[s] + i++ * b, b);
      }
    }
  }
}

// reduce: the all_reduce, kept by the root only.
void reduceAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  const size_t bytes = args.count * elementSize(args.type);
  void* result = ctx.layout().rank == args.root ? args.output : ctx.scratch(bytes);
  allReduceAcrossHosts(ctx, args.input, result, args.count, args.type, args.op);
}

// gather: the all_gather, kept by the root only.
void gatherAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  const HostLayout& L = ctx.layout();
  const size_t bytes = args.count * elementSize(args.type);
  std::vector<void*> outputs = args.outputs;
  if (L.rank != args.root) {
    uint8_t* sink = ctx.scratch(bytes * static_cast<size_t>(L.size));
    outputs.clear();
    for (int q = 0; q < L.size; ++q) outputs.push_back(sink + bytes * static_cast<size_t>(q));
  }
  allGatherAcrossHosts(ctx, args.input, outputs,
                       std::vector<size_t>(static_cast<size_t>(L.size), args.count), args.type, 0);
}

// scatter: the root's blocks broadcast end to end; each rank keeps its own.
void scatterAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  const HostLayout& L = ctx.layout();
  const size_t bytes = args.count * elementSize(args.type);
  uint8_t* all = ctx.scratch(bytes * static_cast<size_t>(L.size));
  if (L.rank == args.root) {
    for (int q = 0; q < L.size; ++q) ctx.copy(all + bytes * q, args.inputs[q], bytes);
  }
  broadcastAcrossHosts(ctx, all, all, args.count * static_cast<size_t>(L.size), args.type,
                       args.root);
  ctx.copy(args.output, all + bytes * static_cast<size_t>(L.rank), bytes);
}

}  // namespace

void runAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  switch (args.kind) {
    case CollectiveKind::kAllReduce:
      return allReduceAcrossHosts(ctx, args.input, args.output, args.count, args.type, args.op);
    case CollectiveKind::kAllGather:
      return allGatherAcrossHosts(ctx, args.input, args.outputs, args.outputCounts, args.type,
                                  args.countsHash);
    case CollectiveKind::kReduceScatter:
      return reduceScatterAcrossHosts(ctx, args.inputs, args.inputCounts, args.output, args.type,
                                      args.op, args.countsHash);
    case CollectiveKind::kBroadcast:
      return broadcastAcrossHosts(ctx, args.input, args.output, args.count, args.type, args.root);
    case CollectiveKind::kAllToAll: {
      const size_t bytes =
          args.count * elementSize(args.type) * static_cast<size_t>(ctx.layout().size);
      if (!args.variable && bytes <= kCarriedAllToAllBytes) return carriedAllToAll(ctx, args);
      return allToAllAcrossHosts(ctx, args);
    }
    case CollectiveKind::kReduce: return reduceAcrossHosts(ctx, args);
    case CollectiveKind::kGather: return gatherAcrossHosts(ctx, args);
    case CollectiveKind::kScatter: return scatterAcrossHosts(ctx, args);
    case CollectiveKind::kBarrier: {
      uint8_t* token = ctx.scratch(1);
      ctx.zero(token, 1);
      return allReduceAcrossHosts(ctx, token, token, 1, DataType::kUInt8,
                                  ReduceOp(ReduceKind::kBitOr));
    }
  }
}

}  // namespace loom
