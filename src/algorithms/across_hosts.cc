// Collectives across hosts: the network exchange, hierarchical all_reduce, direct
// all_to_all, and the collectives derived from all_reduce.

#include "algorithms/across_hosts.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>

#include "kernels/reduce.h"

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;

// Below this many bytes all_reduce uses one rail: fewer local steps beat spreading a few
// kilobytes over several NICs.
constexpr size_t kOneRailBytes = size_t{64} << 10;

uint8_t* bytesAt(void* p, size_t offset) {
  return static_cast<uint8_t*>(p) + offset;
}

// ---- all_reduce ----

// The ring all_reduce of `count` elements at `data` among `ring` (communicator ranks, one
// per host, in host order; this rank at `position`): reduce-scatter, then all-gather, one
// chunk per host. Each chunk is reduced along the ring in one fixed order and then copied,
// so every host ends with the same bits.
void ringAllReduce(AcrossHostsContext& ctx, uint8_t* data, size_t count, DataType type, ReduceOp op,
                   const std::vector<int>& ring, int position) {
  const int n = static_cast<int>(ring.size());
  if (n == 1 || count == 0) return;
  const size_t esize = elementSize(type);
  const int next = ring[(position + 1) % n];
  const int prev = ring[(position + n - 1) % n];
  auto chunk = [&](int c) { return sliceOf(count, ((c % n) + n) % n, n, 1); };
  size_t largest = 0;
  for (int c = 0; c < n; ++c) largest = std::max(largest, chunk(c).second - chunk(c).first);
  std::vector<uint8_t> incoming(largest * esize);
  const kernels::ReduceSpec spec{type, op, 1};
  for (int step = 0; step < n - 1; ++step) {
    const auto [sb, se] = chunk(position - step);
    const auto [rb, re] = chunk(position - step - 1);
    const NetTransfer send{next, data + sb * esize, (se - sb) * esize, step};
    const NetTransfer recv{prev, incoming.data(), (re - rb) * esize, step};
    ctx.exchange({&send, 1}, {&recv, 1});
    const void* srcs[2] = {data + rb * esize, incoming.data()};
    kernels::reduce(data + rb * esize, srcs, 2, re - rb, spec);
  }
  for (int step = 0; step < n - 1; ++step) {
    const auto [sb, se] = chunk(position + 1 - step);
    const auto [rb, re] = chunk(position - step);
    const NetTransfer send{next, data + sb * esize, (se - sb) * esize, n + step};
    const NetTransfer recv{prev, data + rb * esize, (re - rb) * esize, n + step};
    ctx.exchange({&send, 1}, {&recv, 1});
  }
}

void allReduceAcrossHosts(AcrossHostsContext& ctx, const void* input, void* output, size_t count,
                          DataType type, ReduceOp op) {
  const HostLayout& L = ctx.layout();
  const size_t esize = elementSize(type);
  const int rails = count * esize < kOneRailBytes ? 1 : L.rails;
  // Within a host: AVG sums (the division by all ranks comes once, at the end) and
  // PREMUL_SUM scales each input once; between hosts partial results are summed.
  const ReduceKind kind = op.kind();
  const ReduceOp localOp = kind == ReduceKind::kAvg ? ReduceOp(ReduceKind::kSum) : op;
  const ReduceOp railOp =
      kind == ReduceKind::kAvg || kind == ReduceKind::kPremulSum ? ReduceOp(ReduceKind::kSum) : op;
  auto slice = [&](int s) { return sliceOf(count, s, rails, lineElements(type)); };
  for (int s = 0; s < rails; ++s) {
    const auto [b, e] = slice(s);
    if (b == e) continue;
    auto args = CollectiveArgs::of(CollectiveKind::kReduce, type, localOp, s, e - b,
                                   static_cast<const uint8_t*>(input) + b * esize,
                                   bytesAt(output, b * esize));
    ctx.runLocal(args);
  }
  if (L.localIndex < rails) {
    const auto [b, e] = slice(L.localIndex);
    std::vector<int> ring;
    for (const auto& ranks : L.ranksOn) ring.push_back(ranks[L.localIndex]);
    uint8_t* mine = bytesAt(output, b * esize);
    ringAllReduce(ctx, mine, e - b, type, railOp, ring, L.host);
    if (kind == ReduceKind::kAvg) {
      const void* src = mine;
      kernels::reduce(mine, &src, 1, e - b, {type, op, L.size});  // divides by the ranks
    }
  }
  for (int s = 0; s < rails; ++s) {
    const auto [b, e] = slice(s);
    if (b == e) continue;
    auto args = CollectiveArgs::of(CollectiveKind::kBroadcast, type, ReduceOp(), s, e - b,
                                   bytesAt(output, b * esize), bytesAt(output, b * esize));
    ctx.runLocal(args);
  }
}

// Bytes from every rank combined into one buffer everywhere: each rank's bytes go to their
// place in a zeroed buffer, and a bitwise OR across ranks puts them together exactly.
void orTogether(AcrossHostsContext& ctx, std::vector<uint8_t>& buffer) {
  allReduceAcrossHosts(ctx, buffer.data(), buffer.data(), buffer.size(), DataType::kUInt8,
                       ReduceOp(ReduceKind::kBitOr));
}

size_t sum(const std::vector<size_t>& counts, size_t upTo) {
  size_t total = 0;
  for (size_t i = 0; i < upTo; ++i) total += counts[i];
  return total;
}

// ---- all_to_all ----

// Blocks for this host's ranks go through the segment; blocks for the others go directly
// over the network, all at once.
void allToAllAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  const HostLayout& L = ctx.layout();
  const size_t esize = elementSize(args.type);
  const std::vector<int>& here = L.ranksOn[L.host];
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
    if (std::find(here.begin(), here.end(), q) != here.end()) continue;
    sends.push_back({q, const_cast<void*>(args.inputs[q]), args.inputCounts[q] * esize, 0});
    receives.push_back({q, args.outputs[q], args.outputCounts[q] * esize, 0});
  }
  ctx.exchange(sends, receives);
}

}  // namespace

// ---- the exchange ----

void AcrossHostsContext::failWith(ErrorCode code, int q, const std::string& message) {
  failures_.fail(code, q, message);
  throw failures_.failureError(wait_.op);
}

void AcrossHostsContext::exchange(std::span<const NetTransfer> sends,
                                  std::span<const NetTransfer> receives) {
  struct Receiving {
    const NetTransfer* transfer;
    bool started = false;
    size_t done = 0;
  };
  // A send is done once its link has taken all of it and it has left this process: a
  // network link moves queued frames only while driven, and the peer may be waiting for
  // them before it sends what this rank waits for (a ring of three or more hosts).
  std::vector<uint64_t> sent(sends.size(), 0);
  std::vector<bool> handedOver(sends.size(), false), sendDone(sends.size(), false);
  std::vector<Receiving> receiving;
  for (const NetTransfer& r : receives) receiving.push_back({&r});
  size_t left = sends.size() + receives.size();
  size_t idleTurns = 0;
  const std::string op(wait_.op);
  int current = -1;  // the peer being driven, for failure messages
  try {
    while (left > 0) {
      if (failures_.failed()) throw failures_.failureError(op);
      bool progressed = false;
      for (size_t i = 0; i < sends.size(); ++i) {
        if (sendDone[i]) continue;
        const NetTransfer& t = sends[i];
        current = t.peer;
        MessageLink& link = linkTo_(t.peer);
        if (!handedOver[i]) {
          const uint64_t before = sent[i];
          handedOver[i] =
              link.write({t.tag, t.bytes}, static_cast<const uint8_t*>(t.data), sent[i]);
          progressed |= sent[i] != before || handedOver[i];
        }
        if (handedOver[i] && link.drained()) {
          sendDone[i] = true;
          progressed = true;
          --left;
        }
      }
      for (Receiving& r : receiving) {
        const NetTransfer& t = *r.transfer;
        if (r.started && r.done == t.bytes) continue;
        current = t.peer;
        MessageLink& link = linkTo_(t.peer);
        if (!link.readable()) continue;
        if (!r.started) {
          const std::optional<Envelope> envelope = link.nextEnvelope();
          if (!envelope) continue;
          if (envelope->tag != t.tag || envelope->bytes != t.bytes) {
            failWith(ErrorCode::kMismatch, t.peer,
                     std::string(op) + " #" + std::to_string(wait_.seq) + ": " + describe_(t.peer) +
                         " sent " + std::to_string(envelope->bytes) + " bytes for step " +
                         std::to_string(envelope->tag) + " where this rank expected " +
                         std::to_string(t.bytes) + " for step " + std::to_string(t.tag) +
                         ": the ranks issued different collectives, counts or types");
          }
          r.started = true;
          progressed = true;
        }
        const size_t n = link.read(static_cast<uint8_t*>(t.data) + r.done, t.bytes - r.done);
        r.done += n;
        progressed |= n > 0;
        if (r.done == t.bytes) --left;
      }
      if (progressed) {
        idleTurns = 0;
        continue;
      }
      // Idle: a short spin, then yield, then sleep a little (the network rings no bell).
      if (Clock::now() >= wait_.deadline) {
        failWith(ErrorCode::kTimeout, current,
                 std::string(op) + " #" + std::to_string(wait_.seq) + " hit its timeout of " +
                     std::to_string(wait_.timeout.count()) + " ms waiting for " +
                     describe_(current) + " over the network");
      }
      ++idleTurns;
      if (idleTurns < 64) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kPeerFailure && !failures_.failed() && current >= 0) {
      failures_.peerLost(current, e.detail());  // a link broke: name its peer
      throw failures_.failureError(op);
    }
    throw;
  }
}

// ---- the collectives ----

void runAcrossHosts(AcrossHostsContext& ctx, const CollectiveArgs& args) {
  const HostLayout& L = ctx.layout();
  const size_t esize = elementSize(args.type);
  switch (args.kind) {
    case CollectiveKind::kAllReduce:
      return allReduceAcrossHosts(ctx, args.input, args.output, args.count, args.type, args.op);
    case CollectiveKind::kAllToAll: return allToAllAcrossHosts(ctx, args);
    case CollectiveKind::kBarrier: {
      std::vector<uint8_t> token(1, 0);
      return orTogether(ctx, token);
    }
    case CollectiveKind::kBroadcast: {
      std::vector<uint8_t> buffer(args.count * esize, 0);
      if (L.rank == args.root && args.count != 0)
        std::memcpy(buffer.data(), args.input, buffer.size());
      orTogether(ctx, buffer);
      if (!buffer.empty()) std::memcpy(args.output, buffer.data(), buffer.size());
      return;
    }
    case CollectiveKind::kReduce: {
      std::vector<uint8_t> buffer(args.count * esize);
      allReduceAcrossHosts(ctx, args.input, buffer.data(), args.count, args.type, args.op);
      if (L.rank == args.root && !buffer.empty())
        std::memcpy(args.output, buffer.data(), buffer.size());
      return;
    }
    case CollectiveKind::kAllGather:
    case CollectiveKind::kGather: {
      // Every rank knows every count (all_gather: outputCounts; gather: the common count).
      std::vector<size_t> counts =
          args.kind == CollectiveKind::kAllGather
              ? args.outputCounts
              : std::vector<size_t>(static_cast<size_t>(L.size), args.count);
      std::vector<uint8_t> buffer(sum(counts, counts.size()) * esize, 0);
      const size_t mine = counts[static_cast<size_t>(L.rank)] * esize;
      if (mine != 0) std::memcpy(buffer.data() + sum(counts, L.rank) * esize, args.input, mine);
      orTogether(ctx, buffer);
      if (args.kind == CollectiveKind::kGather && L.rank != args.root) return;
      for (int q = 0; q < L.size; ++q) {
        if (counts[q] != 0) {
          std::memcpy(args.outputs[q], buffer.data() + sum(counts, q) * esize, counts[q] * esize);
        }
      }
      return;
    }
    case CollectiveKind::kScatter: {
      std::vector<uint8_t> buffer(args.count * esize * static_cast<size_t>(L.size), 0);
      if (L.rank == args.root) {
        for (int q = 0; q < L.size; ++q) {
          if (args.count != 0) {
            std::memcpy(buffer.data() + q * args.count * esize, args.inputs[q], args.count * esize);
          }
        }
      }
      orTogether(ctx, buffer);
      if (args.count != 0) {
        std::memcpy(args.output, buffer.data() + L.rank * args.count * esize, args.count * esize);
      }
      return;
    }
    case CollectiveKind::kReduceScatter: {
      const std::vector<size_t>& counts = args.inputCounts;
      std::vector<uint8_t> buffer(sum(counts, counts.size()) * esize);
      for (int q = 0; q < L.size; ++q) {
        if (counts[q] != 0) {
          std::memcpy(buffer.data() + sum(counts, q) * esize, args.inputs[q], counts[q] * esize);
        }
      }
      allReduceAcrossHosts(ctx, buffer.data(), buffer.data(), sum(counts, counts.size()), args.type,
                           args.op);
      if (counts[L.rank] != 0) {
        std::memcpy(args.output, buffer.data() + sum(counts, L.rank) * esize,
                    counts[L.rank] * esize);
      }
      return;
    }
  }
}

}  // namespace loom
