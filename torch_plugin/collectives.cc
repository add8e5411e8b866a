// ProcessGroupLoom's collectives: checks, staging and the loom call for each c10d entry.

#include <algorithm>

#include "launch.h"

namespace loom::torch_plugin {

namespace {

using c10d::OpType;

// Data pointers of a list of tensors (as loom wants them for per-rank blocks).
std::vector<void*> pointers(const std::vector<at::Tensor>& tensors) {
  std::vector<void*> ptrs;
  for (const auto& t : tensors) ptrs.push_back(t.data_ptr());
  return ptrs;
}

// Checks a per-rank list has one tensor per rank.
void requirePerRank(const CallSite& site, const char* what, size_t n) {
  if (n != static_cast<size_t>(site.size)) {
    invalid(site, std::string(what) + " has " + std::to_string(n) +
                      " tensors; it needs one per rank (" + std::to_string(site.size) + ")");
  }
}

// An all_gather into a list of per-rank tensors, checked and staged.
struct GatherPlan {
  Outputs staged;
  Flat in;
  std::vector<at::Tensor> targets;
  std::vector<size_t> counts;  // elements from each rank (uneven sizes allowed)
};

GatherPlan planAllgather(const CallSite& s, const std::vector<at::Tensor>& outputs,
                         const at::Tensor& input) {
  requireDense(s, "input", input);
  requirePerRank(s, "output list", outputs.size());
  GatherPlan plan{Outputs(s), movementView(input), {}, {}};
  const DataType type = plan.in.type;
  for (size_t q = 0; q < outputs.size(); ++q) {
    requireDense(s, "outputs", outputs[q]);
    if (outputs[q].scalar_type() != input.scalar_type()) {
      invalid(s, "output " + std::to_string(q) + " has dtype " +
                     c10::toString(outputs[q].scalar_type()) + " but the input has " +
                     c10::toString(input.scalar_type()));
    }
    plan.counts.push_back(elementsOf(outputs[q], type));
  }
  if (outputs[s.rank].numel() != input.numel()) {
    invalid(s, "this rank's output tensor has " + std::to_string(outputs[s.rank].numel()) +
                   " elements but its input has " + std::to_string(input.numel()));
  }
  plan.targets = plan.staged.targets(outputs);
  plan.in = listGatherReadApart(s, plan.in, plan.targets);
  return plan;
}

void requireRoot(const CallSite& site, int64_t root) {
  if (root < 0 || root >= site.size) {
    invalid(site,
            "root " + std::to_string(root) + " is outside [0, " + std::to_string(site.size) + ")");
  }
}

// The root's tensor among its `tensors` (BroadcastOptions and ReduceOptions::rootTensor):
// loom takes one tensor per call, so only 0 names one.
void requireRootTensor(const CallSite& site, int64_t rootTensor) {
  if (rootTensor != 0) {
    invalid(site, "rootTensor " + std::to_string(rootTensor) +
                      " names no tensor of the call; loom takes one tensor per call (rootTensor "
                      "0)");
  }
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::broadcast(std::vector<at::Tensor>& tensors,
                                                           const c10d::BroadcastOptions& opts) {
  CallSite s = site("broadcast", !opts.asyncOp);
  requireOne(s, "tensors", tensors.size());
  requireDense(s, "tensor", tensors[0]);
  requireRoot(s, opts.rootRank);
  requireRootTensor(s, opts.rootTensor);
  const Flat flat = movementView(tensors[0]);
  Outputs outputs(s);
  // The root's tensor is only read: a staged copy of it is kept until the call is done, and
  // nothing is copied back.
  const bool root = rank_ == opts.rootRank;
  s.writes = !root;
  if (!root) outputs.inOut(flat);
  return launch(s, OpType::BROADCAST, "loom:broadcast", tensors, tensors,
                root ? copyBack(std::move(outputs), flat) : copyBack(std::move(outputs)),
                [&](Requests& r) {
                  r.push_back(comm_->broadcast(flat.ptr(), flat.ptr(), flat.count, flat.type,
                                               static_cast<int>(opts.rootRank),
                                               opOptions(opts.timeout, !opts.asyncOp)));
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::allreduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::AllreduceOptions& opts) {
  const CallSite s = site("all_reduce", !opts.asyncOp);
  requireOne(s, "tensors", tensors.size());
  if (tensors[0].defined() && tensors[0].is_sparse()) return allreduceSparse(tensors, opts);
  requireDense(s, "tensor", tensors[0]);
  if (opts.sparseIndices) invalid(s, "all_reduce with sparse indices is not supported");
  const Flat flat = reductionView(s, tensors[0], opts.reduceOp);
  const ReduceOp op = reduceOpOf(s, opts.reduceOp, flat);
  Outputs outputs(s);
  outputs.inOut(flat);
  return launch(s, OpType::ALLREDUCE, "loom:all_reduce", tensors, tensors,
                copyBack(std::move(outputs)), [&](Requests& r) {
                  r.push_back(comm_->allReduce(flat.ptr(), flat.ptr(), flat.count, flat.type, op,
                                               opOptions(opts.timeout, !opts.asyncOp)));
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  // torch issues this call at the end of a _coalescing_manager block, then ends the block:
  // an error here is held until then, or the block would stay open (heldInBlock).
  return heldInBlock(OpType::COALESCED, [&]() -> c10::intrusive_ptr<c10d::Work> {
    const CallSite s = site("all_reduce_coalesced", !opts.asyncOp);
    if (tensors.empty()) invalid(s, "needs at least one tensor");
    // One all_reduce per dtype (in the order each first appears, which every rank's list
    // shares), over that dtype's tensors laid end to end, then the pieces copied back: a
    // block may mix dtypes, as NCCL's does.
    std::vector<std::vector<size_t>> byType;
    for (size_t i = 0; i < tensors.size(); ++i) {
      requireDense(s, "tensors", tensors[i]);
      auto same = std::find_if(byType.begin(), byType.end(), [&](const std::vector<size_t>& g) {
        return tensors[g[0]].scalar_type() == tensors[i].scalar_type();
      });
      if (same == byType.end()) {
        byType.push_back({i});
      } else {
        same->push_back(i);
      }
    }
    std::vector<at::Tensor> packs;
    std::vector<Flat> flats;
    std::vector<ReduceOp> ops;
    for (const std::vector<size_t>& group : byType) {
      std::vector<at::Tensor> pieces;
      for (size_t i : group) pieces.push_back(tensors[i].reshape(-1));
      for (const at::Tensor& piece : pieces) settleBeforeCopying(piece);
      packs.push_back(at::cat(pieces));
      noteStaged(packs.back());
      flats.push_back(reductionView(s, packs.back(), opts.reduceOp));
      ops.push_back(reduceOpOf(s, opts.reduceOp, flats.back()));
    }
    auto finisher = [tensors, byType, packs, flats] {
      for (size_t g = 0; g < byType.size(); ++g) {
        if (!flats[g].data.is_alias_of(flats[g].view)) copyBackInto(flats[g].view, flats[g].data);
        int64_t offset = 0;
        for (size_t i : byType[g]) {
          const at::Tensor& t = tensors[i];
          writeResult(t, packs[g].narrow(0, offset, t.numel()).view(t.sizes()));
          offset += t.numel();
        }
      }
    };
    return launch(s, OpType::ALLREDUCE_COALESCED, "loom:all_reduce", tensors, tensors, finisher,
                  [&](Requests& r) {
                    for (size_t g = 0; g < flats.size(); ++g) {
                      r.push_back(comm_->allReduce(flats[g].ptr(), flats[g].ptr(), flats[g].count,
                                                   flats[g].type, ops[g],
                                                   opOptions(opts.timeout, !opts.asyncOp)));
                    }
                  });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::reduce(std::vector<at::Tensor>& tensors,
                                                        const c10d::ReduceOptions& opts) {
  CallSite s = site("reduce", !opts.asyncOp);
  requireOne(s, "tensors", tensors.size());
  requireDense(s, "tensor", tensors[0]);
  requireRoot(s, opts.rootRank);
  requireRootTensor(s, opts.rootTensor);
  const Flat flat = reductionView(s, tensors[0], opts.reduceOp);
  const ReduceOp op = reduceOpOf(s, opts.reduceOp, flat);
  Outputs outputs(s);
  // A non-root's tensor is only read, as NCCL's is: a staged copy of it is kept until the
  // call is done, and nothing is copied back (over what the caller wrote there meanwhile).
  const bool root = rank_ == opts.rootRank;
  s.writes = root;
  if (root) outputs.inOut(flat);
  return launch(s, OpType::REDUCE, "loom:reduce", tensors, tensors,
                root ? copyBack(std::move(outputs)) : copyBack(std::move(outputs), flat),
                [&](Requests& r) {
                  r.push_back(comm_->reduce(flat.ptr(), flat.ptr(), flat.count, flat.type, op,
                                            static_cast<int>(opts.rootRank),
                                            opOptions(opts.timeout, !opts.asyncOp)));
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const CallSite s = site("all_gather", !opts.asyncOp);
  requireOne(s, "inputs", inputs.size());
  requireOne(s, "output lists", outputs.size());
  auto plan = std::make_shared<GatherPlan>(planAllgather(s, outputs[0], inputs[0]));
  return launch(
      s, OpType::ALLGATHER, "loom:all_gather", inputs, outputs[0],
      [plan] { plan->staged.finish(); },
      [&](Requests& r) {
        r.push_back(comm_->allGatherV(plan->in.ptr(), pointers(plan->targets), plan->counts,
                                      plan->in.type, opOptions(opts.timeout, !opts.asyncOp)));
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  const CallSite s = site("all_gather_into_tensor", !opts.asyncOp);
  requireWholeOfParts(s, "output", output, "input", input);
  Outputs outputs(s);
  const at::Tensor target = outputs.target(output);
  const Flat in = gatherReadApart(s, movementView(input), target);
  return launch(s, OpType::_ALLGATHER_BASE, "loom:all_gather_into_tensor", {input}, {output},
                copyBack(std::move(outputs), in), [&](Requests& r) {
                  r.push_back(comm_->allGather(in.ptr(), target.data_ptr(), in.count, in.type,
                                               opOptions(opts.timeout, !opts.asyncOp)));
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  // outputs[q][i] receives rank q's inputs[i].
  const CallSite s = site("all_gather_coalesced", !opts.asyncOp);
  requirePerRank(s, "output lists", outputs.size());
  auto plans = std::make_shared<std::vector<GatherPlan>>();
  std::vector<at::Tensor> all;
  for (size_t i = 0; i < inputs.size(); ++i) {
    std::vector<at::Tensor> perRank;
    for (auto& list : outputs) {
      requireCount(s, "each output list", list.size(), inputs.size());
      perRank.push_back(list[i]);
    }
    plans->push_back(planAllgather(s, perRank, inputs[i]));
  }
  {
    std::vector<Flat> ins;
    std::vector<std::vector<at::Tensor>> written;
    for (const GatherPlan& p : *plans) {
      ins.push_back(p.in);
      written.push_back(p.targets);
    }
    readApartAcrossPairs(ins, written);
    for (size_t i = 0; i < ins.size(); ++i) (*plans)[i].in = ins[i];
  }
  for (auto& list : outputs) all.insert(all.end(), list.begin(), list.end());
  // The future holds one list per rank, as Gloo's does (a flat list with one rank).
  const size_t futureLists = outputs.size() > 1 ? outputs.size() : 0;
  return launch(
      s, OpType::ALLGATHER_COALESCED, "loom:all_gather", inputs, all,
      [plans] {
        for (auto& p : *plans) p.staged.finish();
      },
      [&](Requests& r) {
        for (auto& p : *plans) {
          r.push_back(comm_->allGatherV(p.in.ptr(), pointers(p.targets), p.counts, p.in.type,
                                        opOptions(opts.timeout, !opts.asyncOp)));
        }
      },
      futureLists);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  // torch issues this call at the end of a _coalescing_manager block, then ends the block:
  // an error here is held until then, or the block would stay open (heldInBlock).
  return heldInBlock(OpType::COALESCED, [&]() -> c10::intrusive_ptr<c10d::Work> {
    const CallSite s = site("all_gather_into_tensor_coalesced", !opts.asyncOp);
    requireCount(s, "outputs", outputs.size(), inputs.size());
    auto staged = std::make_shared<Outputs>(s);
    std::vector<Flat> ins;
    std::vector<at::Tensor> targets;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const std::string n = "[" + std::to_string(i) + "]";
      requireWholeOfParts(s, "outputs" + n, outputs[i], "inputs" + n, inputs[i]);
      targets.push_back(staged->target(outputs[i]));
      ins.push_back(gatherReadApart(s, movementView(inputs[i]), targets.back()));
    }
    readApartAcrossPairs(ins, targets);
    return launch(
        s, OpType::COALESCED, "loom:all_gather_into_tensor_coalesced", inputs, outputs,
        [staged, ins, targets] { staged->finish(); },
        [&](Requests& r) {
          for (size_t i = 0; i < ins.size(); ++i) {
            r.push_back(comm_->allGather(ins[i].ptr(), targets[i].data_ptr(), ins[i].count,
                                         ins[i].type, opOptions(opts.timeout, !opts.asyncOp)));
          }
        });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const CallSite s = site("gather", !opts.asyncOp);
  requireRoot(s, opts.rootRank);
  requireOne(s, "inputs", inputs.size());
  requireDense(s, "input", inputs[0]);
  const bool root = rank_ == opts.rootRank;
  auto staged = std::make_shared<Outputs>(s);
  std::vector<at::Tensor> targets;
  std::vector<at::Tensor> results;
  if (root) {
    requireOne(s, "output lists", outputs.size());
    requirePerRank(s, "output list", outputs[0].size());
    requireLike(s, "outputs", outputs[0], "the input", inputs[0]);
    targets = staged->targets(outputs[0]);
    results = outputs[0];
  } else if (!outputs.empty() && !outputs[0].empty()) {
    invalid(s, "only the root (rank " + std::to_string(opts.rootRank) + ") passes output tensors");
  }
  // The root's input read apart from its outputs: the engine would refuse an overlap on the
  // root alone, leaving the other ranks waiting.
  const Flat in = listGatherReadApart(s, movementView(inputs[0]), targets);
  return launch(
      s, OpType::GATHER, "loom:gather", inputs, results,
      [staged, targets, in] { staged->finish(); },
      [&](Requests& r) {
        r.push_back(comm_->gather(in.ptr(), pointers(targets), in.count, in.type,
                                  static_cast<int>(opts.rootRank),
                                  opOptions(opts.timeout, !opts.asyncOp)));
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const CallSite s = site("scatter", !opts.asyncOp);
  requireRoot(s, opts.rootRank);
  requireOne(s, "outputs", outputs.size());
  requireDense(s, "output", outputs[0]);
  const bool root = rank_ == opts.rootRank;
  std::vector<Flat> ins;
  std::vector<const void*> sources;
  if (root) {
    requireOne(s, "input lists", inputs.size());
    requirePerRank(s, "input list", inputs[0].size());
    requireLike(s, "inputs", inputs[0], "the output", outputs[0]);
    for (const auto& t : inputs[0]) ins.push_back(movementView(t));
  } else if (!inputs.empty() && !inputs[0].empty()) {
    invalid(s, "only the root (rank " + std::to_string(opts.rootRank) + ") passes input tensors");
  }
  auto staged = std::make_shared<Outputs>(s);
  const at::Tensor target = staged->target(outputs[0]);
  // The root's inputs read apart from its output (the engine would refuse on the root alone).
  listScatterReadApart(s, ins, target);
  for (const Flat& in : ins) sources.push_back(in.ptr());
  const DataType type = movementView(outputs[0]).type;
  return launch(
      s, OpType::SCATTER, "loom:scatter", root ? inputs[0] : std::vector<at::Tensor>{}, outputs,
      [staged, ins, target] { staged->finish(); },
      [&](Requests& r) {
        r.push_back(comm_->scatter(sources, target.data_ptr(), elementsOf(target, type), type,
                                   static_cast<int>(opts.rootRank),
                                   opOptions(opts.timeout, !opts.asyncOp)));
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const CallSite s = site("reduce_scatter", !opts.asyncOp);
  requireOne(s, "outputs", outputs.size());
  requireOne(s, "input lists", inputs.size());
  requirePerRank(s, "input list", inputs[0].size());
  requireDense(s, "output", outputs[0]);
  std::vector<Flat> ins;
  std::vector<const void*> sources;
  std::vector<size_t> counts;
  for (size_t q = 0; q < inputs[0].size(); ++q) {
    requireDense(s, "inputs", inputs[0][q]);
    if (inputs[0][q].scalar_type() != outputs[0].scalar_type()) {
      invalid(s, "input " + std::to_string(q) + " is " + dtypeName(inputs[0][q]) +
                     " but the output is " + dtypeName(outputs[0]) +
                     "; give every tensor of the call one dtype");
    }
    ins.push_back(reductionView(s, inputs[0][q], opts.reduceOp));
    counts.push_back(ins.back().count);
  }
  if (inputs[0][rank_].numel() != outputs[0].numel()) {
    invalid(s, "this rank's input block has " + std::to_string(inputs[0][rank_].numel()) +
                   " elements but the output has " + std::to_string(outputs[0].numel()));
  }
  const Flat out = reductionView(s, outputs[0], opts.reduceOp);
  listScatterReadApart(s, ins, out.data);
  for (const Flat& in : ins) sources.push_back(in.ptr());
  const ReduceOp op = reduceOpOf(s, opts.reduceOp, out);
  auto staged = std::make_shared<Outputs>(s);
  staged->inOut(out);
  return launch(
      s, OpType::REDUCE_SCATTER, "loom:reduce_scatter", inputs[0], outputs,
      [staged, ins, out] { staged->finish(); },
      [&](Requests& r) {
        r.push_back(comm_->reduceScatterV(sources, out.ptr(), counts, out.type, op,
                                          opOptions(opts.timeout, !opts.asyncOp)));
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const CallSite s = site("reduce_scatter_tensor", !opts.asyncOp);
  requireWholeOfParts(s, "input", input, "output", output);
  const Flat out = reductionView(s, output, opts.reduceOp);
  const Flat in = scatterReadApart(s, reductionView(s, input, opts.reduceOp), out.data);
  const ReduceOp op = reduceOpOf(s, opts.reduceOp, out);
  Outputs outputs(s);
  outputs.inOut(out);
  return launch(s, OpType::_REDUCE_SCATTER_BASE, "loom:reduce_scatter_tensor", {input}, {output},
                copyBack(std::move(outputs), in), [&](Requests& r) {
                  r.push_back(comm_->reduceScatter(in.ptr(), out.ptr(), out.count, out.type, op,
                                                   opOptions(opts.timeout, !opts.asyncOp)));
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  // torch issues this call at the end of a _coalescing_manager block, then ends the block:
  // an error here is held until then, or the block would stay open (heldInBlock).
  return heldInBlock(OpType::COALESCED, [&]() -> c10::intrusive_ptr<c10d::Work> {
    const CallSite s = site("reduce_scatter_tensor_coalesced", !opts.asyncOp);
    requireCount(s, "outputs", outputs.size(), inputs.size());
    std::vector<Flat> ins, outs;
    std::vector<ReduceOp> ops;
    auto staged = std::make_shared<Outputs>(s);
    for (size_t i = 0; i < inputs.size(); ++i) {
      const std::string n = "[" + std::to_string(i) + "]";
      requireWholeOfParts(s, "inputs" + n, inputs[i], "outputs" + n, outputs[i]);
      outs.push_back(reductionView(s, outputs[i], opts.reduceOp));
      ins.push_back(
          scatterReadApart(s, reductionView(s, inputs[i], opts.reduceOp), outs.back().data));
      ops.push_back(reduceOpOf(s, opts.reduceOp, outs.back()));
      staged->inOut(outs.back());
    }
    std::vector<at::Tensor> written;
    for (const Flat& out : outs) written.push_back(out.data);
    readApartAcrossPairs(ins, written);
    return launch(
        s, OpType::COALESCED, "loom:reduce_scatter_tensor_coalesced", inputs, outputs,
        [staged, ins, outs] { staged->finish(); },
        [&](Requests& r) {
          for (size_t i = 0; i < ins.size(); ++i) {
            r.push_back(comm_->reduceScatter(ins[i].ptr(), outs[i].ptr(), outs[i].count,
                                             outs[i].type, ops[i],
                                             opOptions(opts.timeout, !opts.asyncOp)));
          }
        });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes, const c10d::AllToAllOptions& opts) {
  const CallSite s = site("all_to_all_single", !opts.asyncOp);
  requireDense(s, "input", input);
  requireDense(s, "output", output);
  if (output.scalar_type() != input.scalar_type()) {
    invalid(s, "the output is " + dtypeName(output) + " but the input is " + dtypeName(input) +
                   "; give both one dtype");
  }
  Outputs outputs(s);
  const at::Tensor target = outputs.target(output);
  const bool equalBlocks = inputSplitSizes.empty() && outputSplitSizes.empty();
  const Flat in = allToAllReadApart(movementView(input), target, equalBlocks);
  const auto requireEvenRows = [&](const at::Tensor& t, const char* what) {
    if (t.dim() == 0 || t.size(0) % size_ != 0) {
      invalid(s, std::string(what) + " has " + std::to_string(t.dim() ? t.size(0) : 0) +
                     " rows, which do not divide evenly among " + std::to_string(size_) + " ranks");
    }
  };
  if (equalBlocks) {
    // Every block is the same size: the equal form, which the engine can run in ways the
    // per-pair form cannot (across hosts, small ones through carriers), and which needs no
    // exchange of counts. The output must be the input's size, or peers' blocks would be
    // written past its end.
    if (output.nbytes() != input.nbytes()) {
      invalid(s, "output has " + std::to_string(output.nbytes()) + " bytes but the input has " +
                     std::to_string(input.nbytes()) +
                     "; without split sizes they must be the same size (or pass "
                     "output_split_sizes and input_split_sizes)");
    }
    requireEvenRows(input, "input");
    requireEvenRows(output, "output");
    const size_t count = in.count / static_cast<size_t>(size_);
    return launch(s, OpType::ALLTOALL_BASE, "loom:all_to_all", {input}, {output},
                  copyBack(std::move(outputs), in), [&](Requests& r) {
                    r.push_back(comm_->allToAll(in.ptr(), target.data_ptr(), count, in.type,
                                                opOptions(opts.timeout, !opts.asyncOp)));
                  });
  }
  const auto rowBytes = [](const at::Tensor& t) -> size_t {
    return t.dim() == 0 || t.size(0) == 0 ? 0 : t.nbytes() / static_cast<size_t>(t.size(0));
  };
  // Bytes per rank block along dim 0: equal blocks if no splits are given.
  auto blocks = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
    std::vector<size_t> bytes;
    if (splits.empty()) {
      requireEvenRows(t, what);
      bytes.assign(static_cast<size_t>(size_), t.nbytes() / static_cast<size_t>(size_));
      return bytes;
    }
    if (splits.size() != static_cast<size_t>(size_)) {
      invalid(s, std::string(what) + "_split_sizes has " + std::to_string(splits.size()) +
                     " entries; it needs one per rank (" + std::to_string(size_) + ")");
    }
    int64_t rows = 0;
    const int64_t available = t.dim() ? t.size(0) : 0;
    for (int64_t n : splits) {
      if (n < 0) invalid(s, std::string(what) + " split sizes must not be negative");
      // Checked before adding: huge sizes must not wrap around to the right total.
      if (n > available - rows) {
        invalid(s, std::string(what) + " split sizes add up to more than the tensor's " +
                       std::to_string(available) + " rows");
      }
      rows += n;
      bytes.push_back(static_cast<size_t>(n) * rowBytes(t));
    }
    if (rows != (t.dim() ? t.size(0) : 0)) {
      invalid(s, std::string(what) + " split sizes add up to " + std::to_string(rows) +
                     " rows but the tensor has " + std::to_string(t.dim() ? t.size(0) : 0));
    }
    return bytes;
  };
  const std::vector<size_t> sendBytes = blocks(input, inputSplitSizes, "input");
  const std::vector<size_t> recvBytes = blocks(output, outputSplitSizes, "output");
  // Row sizes are whole elements, so the byte counts divide evenly.
  const size_t es = elementSize(in.type);
  std::vector<size_t> sendCounts, recvCounts;
  std::vector<const void*> sources;
  std::vector<void*> targets;
  size_t offIn = 0, offOut = 0;
  for (int q = 0; q < size_; ++q) {
    sendCounts.push_back(sendBytes[q] / es);
    recvCounts.push_back(recvBytes[q] / es);
    sources.push_back(static_cast<const uint8_t*>(in.ptr()) + offIn);
    targets.push_back(static_cast<uint8_t*>(target.data_ptr()) + offOut);
    offIn += sendBytes[q];
    offOut += recvBytes[q];
  }
  return launch(s, OpType::ALLTOALL_BASE, "loom:all_to_all", {input}, {output},
                copyBack(std::move(outputs), in), [&](Requests& r) {
                  r.push_back(comm_->allToAllV(sources, sendCounts, targets, recvCounts, in.type,
                                               opOptions(opts.timeout, !opts.asyncOp)));
                });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::alltoall(std::vector<at::Tensor>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllToAllOptions& opts) {
  const CallSite s = site("all_to_all", !opts.asyncOp);
  requirePerRank(s, "inputs", inputs.size());
  requirePerRank(s, "outputs", outputs.size());
  std::vector<Flat> ins;
  std::vector<const void*> sources;
  std::vector<size_t> sendCounts, recvCounts;
  auto staged = std::make_shared<Outputs>(s);
  for (int q = 0; q < size_; ++q) {
    requireDense(s, "inputs", inputs[q]);
    requireDense(s, "outputs", outputs[q]);
    if (inputs[q].scalar_type() != inputs[0].scalar_type() ||
        outputs[q].scalar_type() != inputs[0].scalar_type()) {
      invalid(s, "input " + std::to_string(q) + " is " + dtypeName(inputs[q]) + " and output " +
                     std::to_string(q) + " " + dtypeName(outputs[q]) + " where input 0 is " +
                     dtypeName(inputs[0]) + "; give every tensor of the call one dtype");
    }
    ins.push_back(movementView(inputs[q]));
    recvCounts.push_back(elementsOf(outputs[q], ins.back().type));
  }
  // Outputs that share memory ([t] * world) are written apart and copied back in order, as
  // Gloo writes them; inputs that share memory with an output are read from copies.
  const std::vector<at::Tensor> targets = staged->targets(outputs);
  allToAllReadApart(ins, targets);
  for (const Flat& in : ins) {
    sources.push_back(in.ptr());
    sendCounts.push_back(in.count);
  }
  const DataType type = ins.front().type;
  return launch(
      s, OpType::ALLTOALL, "loom:all_to_all", inputs, outputs,
      [staged, ins, targets] { staged->finish(); },
      [&](Requests& r) {
        r.push_back(comm_->allToAllV(sources, sendCounts, pointers(targets), recvCounts, type,
                                     opOptions(opts.timeout, !opts.asyncOp)));
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::send(std::vector<at::Tensor>& tensors, int dstRank,
                                                      int tag) {
  return heldInBlock(OpType::SEND, [&] {
    const CallSite s = site("send");
    if (dstRank < 0 || dstRank >= size_) {
      invalid(s, "argument 'dst' is " + std::to_string(dstRank) + ", outside [0, " +
                     std::to_string(size_) + "); pass a rank of this group");
    }
    requireOne(s, "tensors", tensors.size());
    requireDense(s, "tensor", tensors[0]);
    const Flat in = movementView(tensors[0]);
    return launch(
        s, OpType::SEND, "loom:send", tensors, tensors, [in] {},
        [&](Requests& r) {
          r.push_back(comm_->send(in.ptr(), in.count, in.type, dstRank, tag, opOptions({})));
        });
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::recv(std::vector<at::Tensor>& tensors, int srcRank,
                                                      int tag) {
  // -1 is loom's kAnySource: here it would silently turn a bad source into a receive from
  // anyone (c10d has recvAnysource for that).
  return heldInBlock(OpType::RECV, [&] {
    if (srcRank < 0 || srcRank >= size_) {
      invalid(site("recv"), "argument 'src' is " + std::to_string(srcRank) + ", outside [0, " +
                                std::to_string(size_) +
                                "); use recv_anysource to receive from any rank");
    }
    return receive(tensors, srcRank, tag, "loom:recv");
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::receive(std::vector<at::Tensor>& tensors,
                                                         int srcRank, int tag, const char* title) {
  const CallSite s = site("recv");
  requireOne(s, "tensors", tensors.size());
  requireDense(s, "tensor", tensors[0]);
  auto staged = std::make_shared<Outputs>(s);
  // A message shorter than the tensor fills its front and leaves the rest as it was.
  const at::Tensor target = staged->target(tensors[0], /*keep=*/true);
  return launch(
      s, srcRank == kAnySource ? OpType::RECVANYSOURCE : OpType::RECV, title, tensors, tensors,
      [staged, target] { staged->finish(); },
      [&](Requests& r) {
        const DataType type = movementView(target).type;
        r.push_back(comm_->recv(target.data_ptr(), elementsOf(target, type), type, srcRank, tag,
                                opOptions({})));
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::recvAnysource(std::vector<at::Tensor>& tensors,
                                                               int tag) {
  return heldInBlock(OpType::RECVANYSOURCE,
                     [&] { return receive(tensors, kAnySource, tag, "loom:recvAnySource"); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::barrier(const c10d::BarrierOptions& opts) {
  const CallSite s = site("barrier", !opts.asyncOp);
  // As NCCL's barrier (an all_reduce on the GPU that the caller's stream then waits for on
  // the host), one on a group with GPU work returns only once every rank's earlier GPU work
  // of the group has run: each rank settles its own before it arrives. An asynchronous
  // barrier settles at issue too (NCCL's would in wait()).
  if (const std::optional<c10::Device> gpu = barrierGpu()) settleGpuWork(*gpu);
  return launch(s, OpType::BARRIER, "loom:barrier", {}, {}, nullptr, [&](Requests& r) {
    r.push_back(comm_->barrier(opOptions(opts.timeout, !opts.asyncOp)));
  });
}

void ProcessGroupLoom::monitoredBarrier(const c10d::BarrierOptions& opts, bool /*waitAllRanks*/) {
  // loom's barrier names the ranks that did not arrive when it times out, which is what a
  // monitored barrier is for.
  try {
    comm_->barrier(opOptions(opts.timeout, !opts.asyncOp)).wait();
  } catch (const Error& e) {
    // As every call's errors: the legend says which global rank each of this group's is.
    const std::string message = std::string("monitored_barrier: ") + e.what() + ties_->legend;
    if (e.code() == ErrorCode::kInvalidArgument) TORCH_CHECK(false, message);
    C10_THROW_ERROR(DistBackendError, message);
  }
}

}  // namespace loom::torch_plugin
