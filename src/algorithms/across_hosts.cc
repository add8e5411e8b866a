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
    case CollectiveKind::kAllToAll: return allToAllAcrossHosts(ctx, args);
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
