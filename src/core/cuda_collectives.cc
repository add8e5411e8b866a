// The collectives and point-to-point transfers of the CUDA executor, as steps over the
// workspaces (see cuda_executor.h for the protocol, cuda_executor.cc for the machinery).

#include <algorithm>
#include <vector>

#include "core/cuda_executor.h"
#include "core/cuda_steps.h"

namespace loom::detail {

void CudaExecutor::reduceAlone(const void* input, void* output, size_t count,
                               const CollectiveArgs& args) {
  Sources own;
  own.add(input);
  reduce(output, own, count, args, noAgreement());
}

void CudaExecutor::checkPeers(uint64_t e, int only) {
  if (e != firstEpoch_) return;
  await(kReady, e, only);
  copy(Segments{}, expecting(e, only));
}

void CudaExecutor::takeFromRoot(const cuda::Segment& piece, int root, uint64_t e) {
  if (e == firstEpoch_) {
    // Published and said before the wait, as every rank of an all_reduce does, so that the
    // root's check (checkPeers) finds it there: raised only after this rank has read the
    // root's slot, it cost ranks that share a GPU a turn more, 2x a broadcast's time
    // (docs/PERFORMANCE.md, "A root that checks its non-roots").
    copy(Segments{}, publishing(e));
    signal(kReady, e);
  }
  await(kReady, e, root);
  copy({piece}, expecting(e, root));
}

void CudaExecutor::allReduce(const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t perStep = chunk_ / es;
  if (size_ == 1) return reduceAlone(args.input, args.output, args.count, args);
  const size_t bytes = args.count * es;
  const bool oneShot = bytes <= paths_.oneShotBytes;
  // Fused two-shot pays three roles of flag waits per step: from fusedTwoShotBytes_ its
  // overlap wins (four H200s: 68-76 us against the stepped path's 116-123 at 4 MiB), below
  // it the two are alike (docs/PERFORMANCE.md, "Where two shots start").
  if (fusable(bytes) && (oneShot || bytes >= fusedTwoShotBytes_)) {
    cuda::FusedParams p{};
    // Large ones around a ring: one sender and one receiver per GPU (docs/PERFORMANCE.md,
    // "A ring all_reduce").
    p.chain = !oneShot && size_ > 2 && bytes >= fusedRingAllReduceBytes_ &&
              cuda::ringReduces(static_cast<int>(args.type), static_cast<int>(args.op.kind()));
    p.twoShot = !oneShot && !p.chain;
    p.root = -1;  // every rank contributes
    for (int q = 0; q < size_; ++q) p.sources[q] = args.input;
    p.pushesTo = p.receivesFrom = everyPeer();
    p.own = args.input;
    p.outputs[0] = args.output;
    p.count = args.count;
    return runFused(p, es, &args);
  }
  steps(args.count, perStep, [&](size_t lo, uint64_t e) {
    const size_t n = clipped(args.count, lo, perStep);
    copy({{in(rank_, e), at(args.input, lo * es), n * es}}, publishing(e));
    signal(kReady, e);
    await(kReady, e);
    Sources srcs;
    if (oneShot) {
      for (int q = 0; q < size_; ++q) srcs.add(in(q, e));
      reduce(at(args.output, lo * es), srcs, n, args, expecting(e));
      return;
    }
    // Shares of whole 16-byte vectors; rank q reduces share q into its reduced half.
    const size_t vector = 16 / std::min<size_t>(es, 16);
    const size_t share = (n / size_ + vector) / vector * vector;
    for (int q = 0; q < size_; ++q) srcs.add(in(q, e) + rank_ * share * es);
    reduce(reduced(rank_, e), srcs, clipped(n, rank_ * share, share), args, expecting(e));
    signal(kReduced, e);
    await(kReduced, e);
    Segments gather;
    for (int q = 0; q < size_; ++q) {
      gather.add(at(args.output, (lo + q * share) * es), reduced(q, e),
                 clipped(n, q * share, share) * es);
    }
    copy(gather, noAgreement());
  });
}

void CudaExecutor::reduceToRoot(const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t perStep = chunk_ / es;
  if (size_ == 1) return reduceAlone(args.input, args.output, args.count, args);
  steps(args.count, perStep, [&](size_t lo, uint64_t e) {
    const size_t n = clipped(args.count, lo, perStep);
    copy({{in(rank_, e), at(args.input, lo * es), n * es}}, publishing(e));
    signal(kReady, e);
    if (rank_ != args.root) return checkPeers(e, args.root);
    await(kReady, e);
    Sources srcs;
    for (int q = 0; q < size_; ++q) srcs.add(in(q, e));
    reduce(at(args.output, lo * es), srcs, n, args, expecting(e));
  });
}

void CudaExecutor::broadcast(const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t bytes = args.count * es;
  if (fusable(bytes) && size_ > 2 && bytes >= fusedTwoShotBroadcastBytes_) {
    // The root scatters a share to every other rank and each passes its share on (an
    // all_gather), so the root's link carries the message once instead of once per peer:
    // from 2 MiB that wins (four GPUs: 38.5 and 41.9 us against 53.5 and 51.0 in one shot).
    // From 32 MiB the message travels a chain instead, every GPU taking it from one sender
    // and passing it to one receiver, as NCCL's ring does: 0.93-1.12x NCCL's bus bandwidth
    // from 32 MiB to 1 GiB against two shots' 0.80-0.92x (four H200s; docs/PERFORMANCE.md,
    // "A chained broadcast").
    cuda::FusedParams p{};
    p.chain = bytes >= fusedChainBroadcastBytes_;
    p.twoShot = !p.chain;
    p.root = args.root;
    if (rank_ == args.root) p.checksQuiet = everyPeer();
    p.own = args.input;
    p.outputs[0] = args.output;
    p.count = args.count * es;
    return runFused(p, 1, nullptr);
  }
  if (fusable(bytes)) {
    cuda::FusedParams p{};
    if (rank_ == args.root) {
      for (int q = 0; q < size_; ++q) p.sources[q] = args.input;
      p.pushesTo = p.checksQuiet = everyPeer();
      p.own = args.input;
    } else {
      p.receivesFrom = 1u << args.root;
    }
    p.outputs[args.root] = args.output;
    p.count = args.count * es;
    return runFused(p, 1, nullptr);
  }
  const size_t perStep = chunk_ / es;
  steps(args.count, perStep, [&](size_t lo, uint64_t e) {
    const size_t bytes = clipped(args.count, lo, perStep) * es;
    if (rank_ == args.root) {
      copy({{in(rank_, e), at(args.input, lo * es), bytes},
            {at(args.output, lo * es), at(args.input, lo * es), bytes}},
           publishing(e));
      signal(kReady, e);
      checkPeers(e);
    } else {
      takeFromRoot({at(args.output, lo * es), in(args.root, e), bytes}, args.root, e);
    }
  });
}

void CudaExecutor::allGather(const CollectiveArgs& args, bool onlyRoot) {
  // Rank q's block: outputCounts[q] elements (count for gather, whose outputs only the
  // root has); each step moves up to a chunk of every block.
  const size_t es = elementSize(args.type);
  const size_t perStep = chunk_ / es;
  auto countOf = [&](int q) { return onlyRoot ? args.count : args.outputCounts[q]; };
  size_t longest = 0;
  for (int q = 0; q < size_; ++q) longest = std::max(longest, countOf(q));
  const bool receives = !onlyRoot || rank_ == args.root;
  bool equal = true;
  for (int q = 0; q < size_; ++q) equal &= countOf(q) == longest;
  if (!onlyRoot && equal && fusable(longest * es * size_)) {
    cuda::FusedParams p{};
    for (int q = 0; q < size_; ++q) {
      p.sources[q] = args.input;
      p.outputs[q] = args.outputs[q];
    }
    p.pushesTo = p.receivesFrom = everyPeer();
    p.own = args.input;
    p.count = longest * es;
    return runFused(p, 1, nullptr);
  }
  steps(longest, perStep, [&](size_t lo, uint64_t e) {
    copy({{in(rank_, e), at(args.input, lo * es), clipped(countOf(rank_), lo, perStep) * es}},
         publishing(e));
    signal(kReady, e);
    if (!receives) return checkPeers(e, args.root);
    await(kReady, e);
    Segments out;
    for (int q = 0; q < size_; ++q) {
      const void* src = q == rank_ ? at(args.input, lo * es) : in(q, e);
      out.add(at(args.outputs[q], lo * es), src, clipped(countOf(q), lo, perStep) * es);
    }
    copy(out, expecting(e));
  });
}

void CudaExecutor::reduceScatter(const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  // The slot holds one block per rank.
  const size_t block = roundDown(chunk_ / size_, 16);
  const size_t perStep = block / es;
  auto countOf = [&](int q) { return args.variable ? args.inputCounts[q] : args.count; };
  size_t longest = 0;
  for (int q = 0; q < size_; ++q) longest = std::max(longest, countOf(q));
  if (size_ == 1) return reduceAlone(args.inputs[0], args.output, countOf(0), args);
  if (!args.variable && fusable(args.count * es * size_)) {
    cuda::FusedParams p{};
    for (int q = 0; q < size_; ++q) p.sources[q] = args.inputs[q];
    p.pushesTo = p.receivesFrom = everyPeer();
    p.own = args.inputs[rank_];
    p.outputs[0] = args.output;
    p.count = args.count;
    return runFused(p, es, &args);
  }
  // This rank's own block is read where it is, unless that would cost the reduction its
  // 16-byte loads (it takes them only when every source is aligned; steps start at
  // multiples of `block`, so the input's own alignment decides): then it is staged too.
  const bool ownInPlace = reinterpret_cast<uintptr_t>(args.inputs[rank_]) % 16 == 0;
  steps(longest, perStep, [&](size_t lo, uint64_t e) {
    Segments stage;
    for (int q = 0; q < size_; ++q) {
      if (q == rank_ && ownInPlace) continue;
      stage.add(in(rank_, e) + q * block, at(args.inputs[q], lo * es),
                clipped(countOf(q), lo, perStep) * es);
    }
    copy(stage, publishing(e));
    signal(kReady, e);
    await(kReady, e);
    Sources srcs;
    for (int q = 0; q < size_; ++q) {
      const bool own = q == rank_ && ownInPlace;
      srcs.add(own ? at(args.inputs[rank_], lo * es) : in(q, e) + rank_ * block);
    }
    reduce(at(args.output, lo * es), srcs, clipped(countOf(rank_), lo, perStep), args,
           expecting(e));
  });
}

void CudaExecutor::allToAll(const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  if (fusable(args.count * es * size_)) {
    cuda::FusedParams p{};
    for (int q = 0; q < size_; ++q) {
      p.sources[q] = args.inputs[q];
      p.outputs[q] = args.outputs[q];
    }
    p.pushesTo = p.receivesFrom = everyPeer();
    p.own = args.inputs[rank_];
    p.count = args.count * es;
    return runFused(p, 1, nullptr);
  }
  const size_t block = roundDown(chunk_ / size_, 16);
  const size_t perStep = block / es;
  steps(args.count, perStep, [&](size_t lo, uint64_t e) {
    const size_t bytes = clipped(args.count, lo, perStep) * es;
    // This rank's own block goes straight from input to output, the others through the slot.
    Segments stage;
    for (int q = 0; q < size_; ++q) {
      if (q != rank_) stage.add(in(rank_, e) + q * block, at(args.inputs[q], lo * es), bytes);
    }
    copy(stage, publishing(e));
    signal(kReady, e);
    await(kReady, e);
    Segments out;
    for (int q = 0; q < size_; ++q) {
      const void* src = q == rank_ ? at(args.inputs[rank_], lo * es) : in(q, e) + rank_ * block;
      out.add(at(args.outputs[q], lo * es), src, bytes);
    }
    copy(out, expecting(e));
  });
}

void CudaExecutor::allToAllV(const CollectiveArgs& args) {
  // Only the two ends of a pair know its block's size, so the blocks go as transfers (whose
  // chunks are counted per pair), not in collective steps (counted by every rank alike).
  const size_t es = elementSize(args.type);
  std::vector<Transfer> transfers;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    transfers.push_back(
        {Transfer::Kind::kSend, q, 0, const_cast<void*>(args.inputs[q]), args.inputCounts[q] * es});
    transfers.push_back({Transfer::Kind::kRecv, q, 0, args.outputs[q], args.outputCounts[q] * es});
  }
  const size_t own = std::min(args.inputCounts[rank_], args.outputCounts[rank_]) * es;
  const cuda::Segment ownBlock{args.outputs[rank_], args.inputs[rank_], own};
  if (!fusableTransfers() || own == 0 || ownBlock.dst == ownBlock.src) {
    copy({ownBlock}, noAgreement());
    transfer(transfers, kAllToAllBlock);
    return;
  }
  // A fused transfer: the own block is copied on the second stream while the kernel moves
  // the peers' blocks, not before it (copied before, a 1 GiB call took 1.05x the even
  // all_to_all's time on four H200s and 1.18x on two, where the own block is half the bytes;
  // docs/PERFORMANCE.md). The kernel is queued first, so that its blocks are resident
  // before the copy's fill the rest of the GPU.
  alongside([&] { transfer(transfers, kAllToAllBlock); }, [&] { copy({ownBlock}, noAgreement()); });
}

void CudaExecutor::scatter(const CollectiveArgs& args) {
  const size_t es = elementSize(args.type);
  const size_t block = roundDown(chunk_ / size_, 16);
  const size_t perStep = block / es;
  steps(args.count, perStep, [&](size_t lo, uint64_t e) {
    const size_t bytes = clipped(args.count, lo, perStep) * es;
    if (rank_ == args.root) {
      Segments stage;
      for (int q = 0; q < size_; ++q) {
        stage.add(in(rank_, e) + q * block, at(args.inputs[q], lo * es), bytes);
      }
      stage.add(at(args.output, lo * es), at(args.inputs[rank_], lo * es), bytes);
      copy(stage, publishing(e));
      signal(kReady, e);
      checkPeers(e);
    } else {
      takeFromRoot({at(args.output, lo * es), in(args.root, e) + rank_ * block, bytes}, args.root,
                   e);
    }
  });
}

void CudaExecutor::barrier() {
  steps(0, 1, [&](size_t, uint64_t e) {
    copy(Segments{}, publishing(e));
    signal(kReady, e);
    await(kReady, e);
    copy(Segments{}, expecting(e));
  });
}

void CudaExecutor::transfer(std::span<const Transfer> transfers, uint8_t purpose) {
  if (fusableTransfers()) return fusedTransfer(transfers, purpose);
  // Each pair's messages form one stream of chunks per direction, in issue order; a round
  // moves the next chunk of every pair, so no peer's progress waits on another's.
  struct Chunk {
    const Transfer* transfer;
    uint64_t index;
  };
  std::vector<std::vector<Chunk>> out(static_cast<size_t>(size_));
  std::vector<std::vector<Chunk>> in(static_cast<size_t>(size_));
  const size_t mailSlot = lane_->mailSlot;
  size_t rounds = 0;
  for (const Transfer& t : transfers) {
    std::vector<Chunk>& chunks = (t.kind == Transfer::Kind::kSend ? out : in)[t.peer];
    // At least one chunk, even when empty: it carries the descriptor the receiver checks.
    const uint64_t n = std::max<uint64_t>(1, (t.bytes + mailSlot - 1) / mailSlot);
    for (uint64_t c = 0; c < n; ++c) chunks.push_back({&t, c});
    rounds = std::max(rounds, chunks.size());
  }
  // One direction of round k, once its chunks are listed: the waits, the copy (which checks
  // or publishes), then this rank's flag towards every peer it moved a chunk with.
  size_t k = 0;
  auto finishRound = [&](std::span<const FlagStep> waits, const Segments& segments,
                         const cuda::Agreement& agreement,
                         const std::vector<std::vector<Chunk>>& chunks, PairFlag which) {
    queueFlagSteps(waits);
    copy(segments, agreement);
    const std::vector<uint64_t>& count = which == kSent ? lane_->sent : lane_->taken;
    std::array<FlagStep, cuda::kMaxSources> writes;
    size_t n = 0;
    for (int q = 0; q < size_; ++q) {
      if (k < chunks[q].size()) {
        writes[n++] = {pair(rank_, q) + which * kFlagStride,
                       which == kSent ? sentBase(q) : takenBase(q), count[q], false};
      }
    }
    queueFlagSteps({writes.data(), n});
  };
  for (; k < rounds; ++k) {
    std::array<FlagStep, cuda::kMaxSources> waits;
    size_t nwaits = 0;
    // Sends: once the receiver has taken what this slot held, fill it and say so. (In the
    // graph lane the count is relative, and the chunk two back may be an earlier call's.)
    Segments segments;
    cuda::Agreement agreement = transferAgreement();
    for (int q = 0; q < size_; ++q) {
      if (k >= out[q].size()) continue;
      const Chunk& c = out[q][k];
      const uint64_t seq = ++lane_->sent[q];
      if (lane_->onDevice || seq > 2) {
        waits[nwaits++] = {pair(q, rank_) + kTaken * kFlagStride, sentBase(q), seq - 2, true};
      }
      const size_t lo = c.index * mailSlot;
      segments.add(mailbox(q, rank_, seq), at(c.transfer->data, lo),
                   clipped(c.transfer->bytes, lo, mailSlot));
      agreement.publish[agreement.npublish++] = {
          pairDescriptor(rank_, q, seq), describeChunk(*c.transfer, purpose, c.index, seq), q};
    }
    if (agreement.npublish > 0) {
      finishRound({waits.data(), nwaits}, segments, agreement, out, kSent);
    }
    // Receives: once the sender has filled the slot, check what it says, copy it out and
    // free the slot.
    nwaits = 0;
    segments = Segments{};
    agreement = transferAgreement();
    for (int q = 0; q < size_; ++q) {
      if (k >= in[q].size()) continue;
      const Chunk& c = in[q][k];
      const uint64_t seq = ++lane_->taken[q];
      waits[nwaits++] = {pair(q, rank_) + kSent * kFlagStride, takenBase(q), seq, true};
      const size_t lo = c.index * mailSlot;
      segments.add(at(c.transfer->data, lo), mailbox(rank_, q, seq),
                   clipped(c.transfer->bytes, lo, mailSlot));
      agreement.expect[agreement.nexpect++] = {
          pairDescriptor(q, rank_, seq), describeChunk(*c.transfer, purpose, c.index, seq), q};
    }
    if (agreement.nexpect > 0) {
      finishRound({waits.data(), nwaits}, segments, agreement, in, kTaken);
    }
  }
}

}  // namespace loom::detail
