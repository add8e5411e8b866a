// torch.ops.loom.*: loom's collectives as torch operators, for latency-bound callers
// (tensor-parallel inference calls all_reduce on small activations between layers). They
// name their group by string, as torch's functional collectives do (group.group_name),
// run to completion before returning and skip c10d's Work and future: on contiguous CPU
// tensors the collective runs on the calling thread straight over the group's communicator.
// Other calls (CUDA, non-contiguous or complex tensors, all_to_all with split sizes) take
// the group's c10d method with async_op=False, which stages them; results are the same
// either way. The schemas mark what is written (Tensor(a!)) and the in-place and *_out forms
// return nothing, so torch.compile can functionalize them; their fake kernels are in
// python/loom/ops.py.
//
// The same kernels are also bound as plain Python functions (bindEagerOps, behind
// loom.ops.*): an eager call then skips torch's operator dispatch (resolving the overload,
// boxing the arguments, the autograd fallback): 7,037 instructions for a small all_reduce_
// where the operator took 15,283 (docs/PERFORMANCE.md, "loom.ops").

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cctype>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "launch.h"
#include "process_group_loom.h"
#include "tensor_args.h"

namespace loom::torch_plugin {
namespace {

// How the running call was spelled in Python, for messages: torch.ops.loom.<op>, or
// loom.ops.<op> while an eager function runs the kernel (EagerEntry).
thread_local const char* tEntry = "torch.ops.loom.";

/// Marks the calls made through loom.ops's eager functions for the duration of one.
class EagerEntry {
 public:
  EagerEntry() : saved_(tEntry) { tEntry = "loom.ops."; }
  ~EagerEntry() { tEntry = saved_; }
  EagerEntry(const EagerEntry&) = delete;
  EagerEntry& operator=(const EagerEntry&) = delete;

 private:
  const char* saved_;
};

/// "torch.ops.loom.<op>" (or "loom.ops.<op>") for messages, as the caller spelled it.
std::string opName(const char* op) {
  return std::string(tEntry) + op;
}

/// The backend inside torch's desync-debug wrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every
/// backend in a ProcessGroupWrapper, whose header needs Gloo's, which torch does not ship: so
/// through its Python binding's `wrapped_pg`, as torch's own split does); `backend` itself if
/// it is no wrapper.
c10::intrusive_ptr<c10d::Backend> unwrapped(c10::intrusive_ptr<c10d::Backend> backend) {
  if (!Py_IsInitialized()) return backend;
  pybind11::gil_scoped_acquire gil;
  pybind11::object object = pybind11::cast(backend);
  while (pybind11::hasattr(object, "wrapped_pg")) object = object.attr("wrapped_pg");
  return object.cast<c10::intrusive_ptr<c10d::Backend>>();
}

/// The loom backend of the group named `groupName` for tensors on `device` (a
/// ProcessGroupLoom), with a message that says what to pass when the name is unknown or the
/// group is not loom's there.
c10::intrusive_ptr<c10d::Backend> loomGroup(const char* op, const std::string& groupName,
                                            const at::Device& device) {
  // Before the group is known, the rank is the world's (when loom has one).
  const auto called = [&](int rank) {
    return opName(op) + (rank >= 0 ? " (rank " + std::to_string(rank) + ")" : std::string());
  };
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = c10d::resolve_process_group(groupName);
  } catch (const std::exception&) {
    // torch registers a group only in its members' processes: a rank outside it meets this.
    TORCH_CHECK(false, called(worldRank()) + ": no process group is named '" + groupName +
                           "' in this process; pass the group_name of a group this rank is a "
                           "member of and that is still alive (dist.group.WORLD.group_name for "
                           "the default group): a rank outside a new_group has none of it, so "
                           "call the operator on the group's members only");
  }
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = group->getBackend(device.type());
  } catch (const std::exception&) {
    TORCH_CHECK(false, called(group->getRank()) + ": process group '" + groupName +
                           "' has no backend for " + device.str() +
                           " tensors; make it with the loom backend for them");
  }
  if (dynamic_cast<ProcessGroupLoom*>(backend.get()) == nullptr) backend = unwrapped(backend);
  if (dynamic_cast<ProcessGroupLoom*>(backend.get()) == nullptr) {
    TORCH_CHECK(false, called(group->getRank()) + ": process group '" + groupName + "' runs " +
                           device.str() + " tensors on '" + backend->getBackendName() +
                           "', not loom; " + tEntry +
                           "* need a group made with the loom backend "
                           "(init_process_group(\"loom\") or new_group(backend=\"loom\"))");
  }
  return backend;
}

c10d::ReduceOp reduceOpNamed(const CallSite& site, const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "sum") return c10d::ReduceOp::SUM;
  if (lower == "avg") return c10d::ReduceOp::AVG;
  if (lower == "product") return c10d::ReduceOp::PRODUCT;
  if (lower == "min") return c10d::ReduceOp::MIN;
  if (lower == "max") return c10d::ReduceOp::MAX;
  if (lower == "band") return c10d::ReduceOp::BAND;
  if (lower == "bor") return c10d::ReduceOp::BOR;
  if (lower == "bxor") return c10d::ReduceOp::BXOR;
  invalid(site, "reduce_op '" + name +
                    "' is not one of sum, avg, product, min, max, band, bor, bxor (as in "
                    "torch's functional collectives)");
}

/// Whether `tensors` can go to the communicator as they are: contiguous CPU tensors of a
/// type loom reduces or moves as itself (complex and unknown dtypes are staged by c10d's
/// path).
bool direct(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (!t->device().is_cpu() || !t->is_contiguous() || t->is_complex()) return false;
    const at::ScalarType s = t->scalar_type();
    if (s != at::kFloat && s != at::kDouble && s != at::kHalf && s != at::kBFloat16 &&
        s != at::kChar && s != at::kByte && s != at::kShort && s != at::kInt && s != at::kLong &&
        s != at::kBool) {
      return false;
    }
  }
  return true;
}

/// Runs one blocking loom operation of `pg` issued by `issue` on this thread, without the
/// GIL, translating loom's errors as the c10d path does (with the group's legend).
template <class Issue>
void runBlocking(const ProcessGroupLoom& pg, Issue&& issue) {
  const trace::Span span("direct op");  // LOOM_TRACE: as "c10d call" on the c10d path
  try {
    releasingGil([&] { issue().wait(); });
  } catch (const Error& e) {
    rethrowForTorch(e, pg.ties().legend, &pg.ties());
  }
}

/// Waits for a c10d call made with async_op=False (CUDA: already ordered on the caller's
/// stream; CPU: finished).
void waitFor(const c10::intrusive_ptr<c10d::Work>& work) {
  releasingGil([&] { work->wait(); });
}

/// One operator call: the group's loom backend and the call site for messages.
struct DirectCall {
  ProcessGroupLoom& pg;
  CallSite site;
  // Keeps the backend alive for the call: a thread may destroy the group meanwhile, whose
  // communicator's teardown would otherwise wait on this call's operation forever.
  c10::intrusive_ptr<c10d::Backend> alive;
};

/// Refuses an input of an operator that returns a new tensor while autograd would
/// differentiate through it: the operators have no gradient, and torch would hand back an
/// output that requires grad and never gets one.
void requireNoGradient(const CallSite& site, const char* what, const at::Tensor& t) {
  if (t.requires_grad() && at::GradMode::is_enabled()) {
    invalid(site, std::string(what) + " requires grad and grad mode is on, but " + tEntry +
                      "* have no gradient: call them under torch.no_grad() or "
                      "torch.inference_mode(), or use torch.distributed._functional_collectives, "
                      "whose collectives have one");
  }
}

/// Whether writing `t` in place is refused, as copy_ refuses it: a leaf that requires grad (a
/// Parameter) or a view of one, while grad mode is on. Other tensors that require grad
/// (gradients made with create_graph=True, averaged in a hook) are written as c10d's
/// collectives write them.
bool writingRefused(const at::Tensor& t) {
  if (!t.requires_grad() || !at::GradMode::is_enabled()) return false;
  return t.is_leaf() || (t.is_view() && t._base().is_leaf());
}
/// Refuses `t` (named `what`) where writingRefused says so, naming it and what to do.
void requireWritable(const CallSite& site, const char* what, const at::Tensor& t) {
  if (writingRefused(t)) {
    invalid(site, std::string(what) +
                      " is a leaf that requires grad (a Parameter?), or a view of one, and grad "
                      "mode is on; writing it in place is what copy_ refuses too: write it under "
                      "torch.no_grad()");
  }
}

/// Tells autograd that the call wrote `t` in place, as copy_ would: a backward that saved
/// `t` then refuses to run instead of using the new values. (An inference tensor has no
/// version to bump.)
void written(const at::Tensor& t) {
  if (!t.is_inference()) torch::autograd::impl::bump_version(t);
}

/// The checks every operator starts with: the group is loom's for `tensor`'s device, no
/// coalescing block is open on it (a direct call cannot join the block's work), and
/// `tensor` (named `what`) is dense.
DirectCall startCall(const char* op, const std::string& group, const at::Tensor& tensor,
                     const char* what) {
  c10::intrusive_ptr<c10d::Backend> backend = loomGroup(op, group, tensor.device());
  auto& pg = static_cast<ProcessGroupLoom&>(*backend);
  const CallSite site = pg.directSite(op);
  if (pg.isCoalescing()) {
    invalid(site,
            "the group is inside a coalescing block (batch_isend_irecv or "
            "_coalescing_manager; one that raised stays open until the group's next block "
            "starts); " +
                std::string(tEntry) + "* run alone: call them outside it");
  }
  requireDense(site, what, tensor);
  return {pg, site, std::move(backend)};
}

void requireGroupSize(const CallSite& site, int64_t groupSize) {
  if (groupSize != site.size) {
    invalid(site, "group_size is " + std::to_string(groupSize) + " but the group has " +
                      std::to_string(site.size) + " ranks");
  }
}

/// Held while a call takes its group's c10d path: that path's messages name the call's
/// operator (tDirectOp), not the c10d collective underneath.
class NamedAs {
 public:
  explicit NamedAs(const CallSite& site) { tDirectOp = site.op; }
  ~NamedAs() { tDirectOp = nullptr; }
  NamedAs(const NamedAs&) = delete;
  NamedAs& operator=(const NamedAs&) = delete;
};

/// The direct path of both all_reduce forms: `input` reduced into `output` (may be its data).
void allReduceDirect(ProcessGroupLoom& pg, const CallSite& s, c10d::ReduceOp op,
                     const at::Tensor& input, void* output) {
  const Flat in = reductionView(s, input, op);
  const ReduceOp loomOp = reduceOpOf(s, op, in);
  runBlocking(pg, [&] {
    return pg.communicator().allReduce(in.ptr(), output, in.count, in.type, loomOp,
                                       pg.directOptions(c10d::OpType::ALLREDUCE, {input}, {input}));
  });
}

/// Reduces `tensor` in place for call `s`: directly, or through the group's c10d path.
void allReduceWithin(ProcessGroupLoom& pg, const CallSite& s, c10d::ReduceOp op,
                     at::Tensor& tensor) {
  if (direct({&tensor})) {
    allReduceDirect(pg, s, op, tensor, tensor.data_ptr());
    return;
  }
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  opts.asyncOp = false;
  const NamedAs named(s);
  waitFor(pg.allreduce(tensors, opts));
}

void allReduceInPlace(at::Tensor& tensor, const std::string& reduceOp, const std::string& group) {
  auto [pg, s, alive] = startCall("all_reduce_", group, tensor, "tensor");
  requireWritable(s, "tensor", tensor);
  allReduceWithin(pg, s, reduceOpNamed(s, reduceOp), tensor);
  written(tensor);
}

at::Tensor allReduce(const at::Tensor& input, const std::string& reduceOp,
                     const std::string& group) {
  auto [pg, s, alive] = startCall("all_reduce", group, input, "input");
  requireNoGradient(s, "input", input);
  const c10d::ReduceOp op = reduceOpNamed(s, reduceOp);
  at::Tensor output = at::empty_like(input, at::MemoryFormat::Contiguous);
  if (direct({&input})) {
    allReduceDirect(pg, s, op, input, output.data_ptr());
    return output;
  }
  settleBeforeCopying(input);  // a copy taken at issue reads what earlier calls wrote
  output.copy_(input);
  allReduceWithin(pg, s, op, output);
  return output;
}

void broadcastInPlace(at::Tensor& tensor, int64_t src, const std::string& group) {
  auto [pg, s, alive] = startCall("broadcast_", group, tensor, "tensor");
  requireWritable(s, "tensor", tensor);
  if (src < 0 || src >= s.size) {
    invalid(s, "src " + std::to_string(src) + " is not a rank of the group (0 to " +
                   std::to_string(s.size - 1) + ")");
  }
  if (direct({&tensor})) {
    const Flat flat = movementView(tensor);
    runBlocking(pg, [&] {
      return pg.communicator().broadcast(
          flat.ptr(), flat.ptr(), flat.count, flat.type, static_cast<int>(src),
          pg.directOptions(c10d::OpType::BROADCAST, {tensor}, {tensor}));
    });
  } else {
    std::vector<at::Tensor> tensors{tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    opts.asyncOp = false;
    const NamedAs named(s);
    waitFor(pg.broadcast(tensors, opts));
  }
  written(tensor);
}

/// `input`'s shape with dim 0 multiplied by `factor` (a 0-d input counts as one row).
std::vector<int64_t> scaledRows(const at::Tensor& input, int64_t factor) {
  if (input.dim() == 0) return {factor};
  std::vector<int64_t> shape = input.sizes().vec();
  shape[0] *= factor;
  return shape;
}

/// Every rank's `input` into `output`, rows in rank order: the work of both
/// all_gather_into_tensor forms.
void allGatherInto(ProcessGroupLoom& pg, const CallSite& s, const at::Tensor& input,
                   at::Tensor& output) {
  if (direct({&input, &output})) {
    const Flat in = gatherReadApart(s, movementView(input), output);
    runBlocking(pg, [&] {
      return pg.communicator().allGather(
          in.ptr(), output.data_ptr(), in.count, in.type,
          pg.directOptions(c10d::OpType::_ALLGATHER_BASE, {input}, {output}));
    });
    return;
  }
  at::Tensor in = input;
  c10d::AllgatherOptions opts;
  opts.asyncOp = false;
  const NamedAs named(s);
  waitFor(pg._allgather_base(output, in, opts));
}

at::Tensor allGatherIntoTensor(const at::Tensor& input, int64_t groupSize,
                               const std::string& group) {
  auto [pg, s, alive] = startCall("all_gather_into_tensor", group, input, "input");
  requireNoGradient(s, "input", input);
  requireGroupSize(s, groupSize);
  at::Tensor output = at::empty(scaledRows(input, groupSize), input.options());
  allGatherInto(pg, s, input, output);
  return output;
}

void allGatherIntoTensorOut(const at::Tensor& input, int64_t groupSize, const std::string& group,
                            at::Tensor& out) {
  auto [pg, s, alive] = startCall("all_gather_into_tensor_out", group, input, "input");
  requireWritable(s, "out", out);
  requireGroupSize(s, groupSize);
  requireWholeOfParts(s, "out", out, "input", input);
  allGatherInto(pg, s, input, out);
  written(out);
}

/// The checks of reduce_scatter_tensor, after startCall: the group size and rows that divide
/// evenly among the ranks (its output's shape is the input's with fewer rows).
void requireScatterable(const CallSite& s, const at::Tensor& input, int64_t groupSize) {
  requireGroupSize(s, groupSize);
  if (input.dim() == 0 || input.size(0) % groupSize != 0) {
    invalid(s, "input has " + std::to_string(input.dim() ? input.size(0) : 1) +
                   " rows, which do not divide evenly among " + std::to_string(groupSize) +
                   " ranks");
  }
}

/// This rank's block of the reduction of every rank's `input`, into `output`: the work of
/// both reduce_scatter_tensor forms.
void reduceScatterInto(ProcessGroupLoom& pg, const CallSite& s, const at::Tensor& input,
                       const std::string& reduceOp, at::Tensor& output) {
  const c10d::ReduceOp op = reduceOpNamed(s, reduceOp);
  if (direct({&input, &output})) {
    const Flat in = scatterReadApart(s, reductionView(s, input, op), output);
    const ReduceOp loomOp = reduceOpOf(s, op, in);
    runBlocking(pg, [&] {
      return pg.communicator().reduceScatter(
          in.ptr(), output.data_ptr(), in.count / s.size, in.type, loomOp,
          pg.directOptions(c10d::OpType::_REDUCE_SCATTER_BASE, {input}, {output}));
    });
    return;
  }
  at::Tensor in = input;
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = op;
  opts.asyncOp = false;
  const NamedAs named(s);
  waitFor(pg._reduce_scatter_base(output, in, opts));
}

at::Tensor reduceScatterTensor(const at::Tensor& input, const std::string& reduceOp,
                               int64_t groupSize, const std::string& group) {
  auto [pg, s, alive] = startCall("reduce_scatter_tensor", group, input, "input");
  requireNoGradient(s, "input", input);
  requireScatterable(s, input, groupSize);
  std::vector<int64_t> shape = input.sizes().vec();
  shape[0] /= groupSize;
  at::Tensor output = at::empty(shape, input.options());
  reduceScatterInto(pg, s, input, reduceOp, output);
  return output;
}

void reduceScatterTensorOut(const at::Tensor& input, const std::string& reduceOp, int64_t groupSize,
                            const std::string& group, at::Tensor& out) {
  auto [pg, s, alive] = startCall("reduce_scatter_tensor_out", group, input, "input");
  requireWritable(s, "out", out);
  // out says the block's size: the input's elements, not its rows, must divide among the
  // ranks (torch's functional form and dist.reduce_scatter_tensor ask no more).
  requireGroupSize(s, groupSize);
  requireWholeOfParts(s, "input", input, "out", out);
  reduceScatterInto(pg, s, input, reduceOp, out);
  written(out);
}

/// Rows of `input` exchanged with every rank into `output` (of the input's dtype: both
/// callers see to it): the work of both all_to_all_single forms. Equal blocks of tensors the
/// communicator takes as they are go straight to it; per-pair splits (whose checks and
/// exchange of counts live in c10d's path), other tensors, and shapes c10d's path would
/// refuse by name take that path.
void allToAllInto(ProcessGroupLoom& pg, const CallSite& s, const at::Tensor& input,
                  at::IntArrayRef outputSplitSizes, at::IntArrayRef inputSplitSizes,
                  at::Tensor& output) {
  const auto evenRows = [&](const at::Tensor& t) { return t.dim() > 0 && t.size(0) % s.size == 0; };
  // Partly overlapping buffers take c10d's path, which reads the input apart.
  const auto* in0 = static_cast<const uint8_t*>(input.data_ptr());
  const auto* out0 = static_cast<const uint8_t*>(output.data_ptr());
  const bool apart = in0 == out0 || in0 + input.nbytes() <= out0 || out0 + output.nbytes() <= in0;
  if (outputSplitSizes.empty() && inputSplitSizes.empty() && evenRows(input) && evenRows(output) &&
      output.nbytes() == input.nbytes() && apart && direct({&input, &output})) {
    const Flat in = movementView(input);
    runBlocking(pg, [&] {
      return pg.communicator().allToAll(
          in.ptr(), output.data_ptr(), in.count / static_cast<size_t>(s.size), in.type,
          pg.directOptions(c10d::OpType::ALLTOALL_BASE, {input}, {output}));
    });
    return;
  }
  at::Tensor in = input.dim() ? input : input.reshape({1});
  std::vector<int64_t> outSplits = outputSplitSizes.vec();
  std::vector<int64_t> inSplits = inputSplitSizes.vec();
  c10d::AllToAllOptions opts;
  opts.asyncOp = false;
  const NamedAs named(s);
  waitFor(pg.alltoall_base(output, in, outSplits, inSplits, opts));
}

at::Tensor allToAllSingle(const at::Tensor& input, at::IntArrayRef outputSplitSizes,
                          at::IntArrayRef inputSplitSizes, const std::string& group) {
  auto [pg, s, alive] = startCall("all_to_all_single", group, input, "input");
  requireNoGradient(s, "input", input);
  int64_t rows = input.dim() ? input.size(0) : 1;
  if (!outputSplitSizes.empty()) {
    rows = 0;
    for (int64_t n : outputSplitSizes) rows += std::max<int64_t>(n, 0);
  }
  std::vector<int64_t> shape = input.dim() ? input.sizes().vec() : std::vector<int64_t>{1};
  shape[0] = rows;
  at::Tensor output = at::empty(shape, input.options());
  allToAllInto(pg, s, input, outputSplitSizes, inputSplitSizes, output);
  return output;
}

void allToAllSingleOut(const at::Tensor& input, at::IntArrayRef outputSplitSizes,
                       at::IntArrayRef inputSplitSizes, const std::string& group, at::Tensor& out) {
  auto [pg, s, alive] = startCall("all_to_all_single_out", group, input, "input");
  requireDense(s, "out", out);
  requireWritable(s, "out", out);
  if (out.scalar_type() != input.scalar_type()) {
    invalid(s, "out has dtype " + std::string(c10::toString(out.scalar_type())) +
                   " but input has " + c10::toString(input.scalar_type()) +
                   "; pass an out of the input's dtype");
  }
  allToAllInto(pg, s, input, outputSplitSizes, inputSplitSizes, out);
  written(out);
}

/// Before a negative or conjugate view (a math bit) of operator `op`'s argument on group
/// `group` is resolved into a copy: the copy waits for the group's earlier asynchronous calls
/// that write the view's memory, as c10d's staging does (it read what they had not written
/// yet), and a written view whose elements share memory is refused now, by name, before
/// anything is sent (its write back after the collective is what failed).
void prepareResolving(const std::string& op, const std::string& group, const at::Tensor& view,
                      bool written) {
  c10::intrusive_ptr<c10d::Backend> backend = loomGroup(op.c_str(), group, view.device());
  const CallSite site = static_cast<ProcessGroupLoom&>(*backend).directSite(op.c_str());
  if (written && at::has_internal_overlap(view) == at::MemOverlap::Yes) {
    invalid(site,
            "the tensor it writes has elements that share memory (a stride of 0, as expand() "
            "makes), so several results would land in one place; pass a tensor whose elements "
            "are its own");
  }
  settleBeforeCopying(view);
}

/// An argument of an eager call as its kernel gets it. Negative views (whose memory holds
/// the values unnegated) are what torch's dispatcher resolves before an operator's kernel
/// runs, and the eager entry skips the dispatcher: a tensor read is passed as a resolved
/// copy, a tensor written (at::Tensor&) as one written back through the view afterwards.
template <class A>
struct EagerArg {
  explicit EagerArg(A a) : value(std::forward<A>(a)) {}
  A get() { return std::forward<A>(value); }
  void writeBack() {}
  A value;
};
template <>
struct EagerArg<const at::Tensor&> {
  explicit EagerArg(const at::Tensor& t) : resolved(t.resolve_neg()) {}
  const at::Tensor& get() { return resolved; }
  void writeBack() {}
  at::Tensor resolved;
};
template <>
struct EagerArg<at::Tensor&> {
  // A negative view the kernel will refuse to write (requireWritable) reaches it as it is, so
  // the refusal names the caller's tensor before anything is sent (a resolved copy would
  // pass the check, and the write back after the collective would be what fails).
  explicit EagerArg(at::Tensor& t) : view(t), resolved(writingRefused(t) ? t : t.resolve_neg()) {}
  at::Tensor& get() { return resolved; }
  void writeBack() {
    if (!view.is_neg()) return;
    writeResult(view, resolved);  // as the kernels write (inference tensors too)
    written(view);                // the kernel bumped the resolved copy's version, not this
  }
  at::Tensor& view;
  at::Tensor resolved;
};

inline bool negativeView(const at::Tensor& t) {
  return t.is_neg();
}
template <class T>
bool negativeView(const T& /*notATensor*/) {
  return false;
}

/// prepareResolving for an eager call's argument of type A, if it is a negative view.
template <class A>
struct PrepareArg {
  static void run(const std::string& /*op*/, const std::string& /*group*/, const A& /*arg*/) {}
};
template <>
struct PrepareArg<const at::Tensor&> {
  static void run(const std::string& op, const std::string& group, const at::Tensor& t) {
    if (t.is_neg()) prepareResolving(op, group, t, false);
  }
};
template <>
struct PrepareArg<at::Tensor&> {
  static void run(const std::string& op, const std::string& group, const at::Tensor& t) {
    if (t.is_neg() && !writingRefused(t)) prepareResolving(op, group, t, true);
  }
};

/// Notes `arg` in `group` if it is a string: every operator's last string is its group's name.
inline void noteGroupName(const std::string*& group, const std::string& arg) {
  group = &arg;
}
template <class T>
void noteGroupName(const std::string*& /*group*/, const T& /*notAString*/) {}

/// Runs `kernel` (operator `op`) on `args` with negative views resolved (EagerArg).
template <class R, class... Args>
R runResolvingNegativeViews(const std::string& op, R (*kernel)(Args...),
                            std::type_identity_t<Args>... args) {
  const std::string* group = nullptr;
  (noteGroupName(group, args), ...);
  (PrepareArg<Args>::run(op, *group, args), ...);
  std::tuple<EagerArg<Args>...> resolved{EagerArg<Args>(std::forward<Args>(args))...};
  const auto run = [&] {
    return std::apply([&](auto&... a) { return kernel(a.get()...); }, resolved);
  };
  const auto writeBack = [&] { std::apply([](auto&... a) { (a.writeBack(), ...); }, resolved); };
  if constexpr (std::is_void_v<R>) {
    run();
    writeBack();
  } else {
    R result = run();
    writeBack();
    return result;
  }
}

/// A tensor whose calls something else must see: a subclass with its own dispatch
/// (__torch_dispatch__: DTensor, wrapper subclasses), functorch's wrappers (vmap, grad,
/// functionalize), a meta tensor (its fake kernel gives the shape), or any tensor without
/// memory of its own. Its memory, if any, is not what the kernel should read.
inline bool dispatchesItself(const at::Tensor& t) {
  static const c10::DispatchKeySet kWrapped({
      c10::DispatchKey::Python,
      c10::DispatchKey::PythonTLSSnapshot,
      c10::DispatchKey::Functionalize,
      c10::DispatchKey::FuncTorchBatched,
      c10::DispatchKey::BatchedNestedTensor,
      c10::DispatchKey::FuncTorchGradWrapper,
  });
  return t.key_set().has_any(kWrapped) || !t.has_storage() || t.is_meta();
}
template <class T>
bool dispatchesItself(const T& /*notATensor*/) {
  return false;
}

/// Whether this thread runs inside something that records or transforms operators: a
/// torch.jit.trace (which records only what reaches torch's dispatcher: skipped, a
/// collective would be left out of the trace and its output traced as uninitialised
/// memory) or a functorch transform (vmap, grad).
inline bool callsAreRecorded() {
  return torch::jit::tracer::isTracing() || c10::impl::tls_local_dispatch_key_set().included_.has(
                                                c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
}

/// Calls operator `name` (loom::...) through torch's dispatcher, boxed: what
/// torch.ops.loom.<name> does, so a subclass's __torch_dispatch__ decides.
template <class R, class... Args>
R throughDispatcher(const char* name, Args&&... args) {
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  torch::jit::Stack stack;
  (stack.emplace_back(c10::IValue(args)), ...);
  op.callBoxed(&stack);
  if constexpr (!std::is_void_v<R>) return stack.back().toTensor();
}

/// An eager Python function over `kernel`, the operator `name`'s: torch's error translation,
/// as for the operator; its group-resolution errors name loom.ops (its argument refusals,
/// shared with the operator, name the call as "loom all_reduce_ (rank r)").
template <class R, class... Args>
auto eager(const char* name, R (*kernel)(Args...)) {
  return [name, kernel](Args... args) -> R {
    HANDLE_TH_ERRORS
    if ((dispatchesItself(args) || ...) || callsAreRecorded()) {
      return throughDispatcher<R>(name, std::forward<Args>(args)...);
    }
    const EagerEntry entry;
    if ((negativeView(args) || ...)) {
      const std::string op = std::string(name).substr(std::string(name).find("::") + 2);
      return runResolvingNegativeViews(op, kernel, std::forward<Args>(args)...);
    }
    return kernel(std::forward<Args>(args)...);
    END_HANDLE_TH_ERRORS_PYBIND
  };
}

/// The operator's name without "loom::", for messages.
std::string shortName(const c10::OperatorHandle& op) {
  const std::string& full = op.schema().name();
  return full.substr(full.find("::") + 2);
}

/// The autograd kernel of the operators that return a new tensor, none of which has a
/// gradient: an input that requires grad is refused here, ahead of every other kernel, so
/// that eager calls and torch.compile's traces (whose fake tensors never reach the CPU and
/// CUDA kernels) refuse it alike, rather than a compiled backward treating the collective
/// as a constant. Everything else goes on below autograd.
void refuseGradient(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                    torch::jit::Stack* stack) {
  const size_t count = op.schema().arguments().size();
  const c10::IValue& input = torch::jit::peek(*stack, 0, count);  // each one's first argument
  if (input.isTensor() && input.toTensor().requires_grad() && at::GradMode::is_enabled()) {
    const std::string name = shortName(op);
    const std::string& group = torch::jit::peek(*stack, count - 1, count).toStringRef();  // last
    c10::intrusive_ptr<c10d::Backend> backend =
        loomGroup(name.c_str(), group, input.toTensor().device());
    requireNoGradient(static_cast<ProcessGroupLoom&>(*backend).directSite(name.c_str()), "input",
                      input.toTensor());
  }
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

/// The group a boxed call of `count` arguments on `stack` names: every operator's last
/// string argument.
std::string groupArgument(const torch::jit::Stack& stack, size_t count) {
  std::string group;
  for (size_t i = 0; i < count; ++i) {
    const c10::IValue& value = stack[stack.size() - count + i];
    if (value.isString()) group = value.toStringRef();
  }
  return group;
}

/// The autograd kernel of the operators that write a tensor in place: what copy_ does
/// around its write, for eager calls and torch.compile's traces alike (whose fake tensors
/// never reach the CPU and CUDA kernels, which check and bump for loom.ops too): a written
/// leaf that requires grad is refused (requireWritable), and each written tensor's version
/// is bumped afterwards, so a backward that saved it refuses to run rather than use the new
/// values (a compiled one read them: found by an audit's probe).
void writeInPlace(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t count = arguments.size();
  c10::SmallVector<at::Tensor, 1> writes;
  for (size_t i = 0; i < count; ++i) {
    const c10::AliasInfo* alias = arguments[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    const at::Tensor& t = (*stack)[stack->size() - count + i].toTensor();
    if (writingRefused(t)) {
      const std::string name = shortName(op);
      c10::intrusive_ptr<c10d::Backend> backend =
          loomGroup(name.c_str(), groupArgument(*stack, count), t.device());
      requireWritable(static_cast<ProcessGroupLoom&>(*backend).directSite(name.c_str()),
                      arguments[i].name().c_str(), t);
    }
    writes.push_back(t);
  }
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  for (const at::Tensor& t : writes) written(t);
}

/// Every operator's kernel for sparse tensors, whose dispatch keys never reach the CPU and
/// CUDA kernels: the refusal those give (requireDense), naming the operator and the
/// argument, instead of torch's "Could not run 'loom::...' with arguments from the
/// 'SparseCPU' backend".
void refuseSparse(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t count = arguments.size();
  const std::string name = shortName(op);
  const std::string group = groupArgument(*stack, count);
  for (size_t i = 0; i < count; ++i) {
    const c10::IValue& value = (*stack)[stack->size() - count + i];
    if (!value.isTensor() || value.toTensor().layout() == at::kStrided) continue;
    const at::Tensor& t = value.toTensor();
    c10::intrusive_ptr<c10d::Backend> backend = loomGroup(name.c_str(), group, t.device());
    requireDense(static_cast<ProcessGroupLoom&>(*backend).directSite(name.c_str()),
                 arguments[i].name().c_str(), t);
  }
  TORCH_CHECK(false, "loom " + name + ": sparse tensors are not taken; pass dense ones");
}

/// Every operator's kernel for negative and conjugate views (torch's math bits): each such
/// tensor is passed on resolved, and one the operator writes is written back through the
/// caller's view afterwards. torch's own fallback for these keys expects an operator that
/// writes a tensor to return it, which loom's do not (functionalization wants them to return
/// nothing), and reads past the stack. A written view the kernel refuses to write
/// (writingRefused) goes on as it is, so the refusal names the caller's tensor before
/// anything is sent.
void resolveMathBits(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                     torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t count = arguments.size();
  const std::string name = shortName(op);
  const std::string group = groupArgument(*stack, count);
  std::vector<std::pair<at::Tensor, at::Tensor>> writeBack;  // the caller's view, what is written
  for (size_t i = 0; i < count; ++i) {
    c10::IValue& value = (*stack)[stack->size() - count + i];
    if (!value.isTensor()) continue;
    const at::Tensor view = value.toTensor();
    if (!view.is_neg() && !view.is_conj()) continue;
    const bool written = arguments[i].alias_info() && arguments[i].alias_info()->isWrite();
    if (written && writingRefused(view)) continue;
    prepareResolving(name, group, view, written);
    at::Tensor resolved = view.resolve_conj().resolve_neg();
    if (written) writeBack.emplace_back(view, resolved);
    value = std::move(resolved);
  }
  op.redispatchBoxed(keys.remove(c10::DispatchKey::Negative).remove(c10::DispatchKey::Conjugate),
                     stack);
  for (auto& [view, resolved] : writeBack) {
    writeResult(view, resolved);  // inference tensors too
    written(view);  // the kernel bumped the resolved copy's version, not the caller's view's
  }
}

}  // namespace

void bindEagerOps(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("eager_all_reduce_", eager("loom::all_reduce_", &allReduceInPlace), py::arg("tensor"),
        py::arg("reduce_op"), py::arg("group_name"),
        "torch.ops.loom.all_reduce_ without torch's dispatcher.");
  m.def("eager_all_reduce", eager("loom::all_reduce", &allReduce), py::arg("input"),
        py::arg("reduce_op"), py::arg("group_name"),
        "torch.ops.loom.all_reduce without torch's dispatcher.");
  m.def("eager_broadcast_", eager("loom::broadcast_", &broadcastInPlace), py::arg("tensor"),
        py::arg("src"), py::arg("group_name"),
        "torch.ops.loom.broadcast_ without torch's dispatcher.");
  m.def("eager_all_gather_into_tensor", eager("loom::all_gather_into_tensor", &allGatherIntoTensor),
        py::arg("input"), py::arg("group_size"), py::arg("group_name"),
        "torch.ops.loom.all_gather_into_tensor without torch's dispatcher.");
  m.def("eager_reduce_scatter_tensor", eager("loom::reduce_scatter_tensor", &reduceScatterTensor),
        py::arg("input"), py::arg("reduce_op"), py::arg("group_size"), py::arg("group_name"),
        "torch.ops.loom.reduce_scatter_tensor without torch's dispatcher.");
  m.def("eager_all_to_all_single", eager("loom::all_to_all_single", &allToAllSingle),
        py::arg("input"), py::arg("output_split_sizes"), py::arg("input_split_sizes"),
        py::arg("group_name"), "torch.ops.loom.all_to_all_single without torch's dispatcher.");
  m.def("eager_all_gather_into_tensor_out",
        eager("loom::all_gather_into_tensor_out", &allGatherIntoTensorOut), py::arg("input"),
        py::arg("group_size"), py::arg("group_name"), py::arg("out"),
        "torch.ops.loom.all_gather_into_tensor_out without torch's dispatcher.");
  m.def("eager_reduce_scatter_tensor_out",
        eager("loom::reduce_scatter_tensor_out", &reduceScatterTensorOut), py::arg("input"),
        py::arg("reduce_op"), py::arg("group_size"), py::arg("group_name"), py::arg("out"),
        "torch.ops.loom.reduce_scatter_tensor_out without torch's dispatcher.");
  m.def("eager_all_to_all_single_out", eager("loom::all_to_all_single_out", &allToAllSingleOut),
        py::arg("input"), py::arg("output_split_sizes"), py::arg("input_split_sizes"),
        py::arg("group_name"), py::arg("out"),
        "torch.ops.loom.all_to_all_single_out without torch's dispatcher.");
}

TORCH_LIBRARY(loom, m) {
  m.def("all_reduce_(Tensor(a!) tensor, str reduce_op, str group_name) -> ()");
  m.def("all_reduce(Tensor input, str reduce_op, str group_name) -> Tensor");
  m.def("broadcast_(Tensor(a!) tensor, int src, str group_name) -> ()");
  m.def("all_gather_into_tensor(Tensor input, int group_size, str group_name) -> Tensor");
  m.def(
      "reduce_scatter_tensor(Tensor input, str reduce_op, int group_size, str group_name) -> "
      "Tensor");
  m.def(
      "all_to_all_single(Tensor input, SymInt[] output_split_sizes, SymInt[] input_split_sizes, "
      "str group_name) -> Tensor");
  // Into the caller's tensor, as torch's *_out functional collectives: no output to allocate,
  // which for CPU tensors of tens of MiB is fresh memory the kernel must fault in and zero on
  // every call. They return nothing (the in-place forms' schema), which torch.compile
  // functionalizes; loom.ops's functions of the same names return `out`.
  m.def(
      "all_gather_into_tensor_out(Tensor input, int group_size, str group_name, *, "
      "Tensor(a!) out) -> ()");
  m.def(
      "reduce_scatter_tensor_out(Tensor input, str reduce_op, int group_size, str group_name, "
      "*, Tensor(a!) out) -> ()");
  m.def(
      "all_to_all_single_out(Tensor input, SymInt[] output_split_sizes, "
      "SymInt[] input_split_sizes, str group_name, *, Tensor(a!) out) -> ()");
}

// The same kernels for CPU and CUDA tensors: each picks its path by the tensors.
#define LOOM_DIRECT_OPS(m)                                       \
  m.impl("all_reduce_", &allReduceInPlace);                      \
  m.impl("all_reduce", &allReduce);                              \
  m.impl("broadcast_", &broadcastInPlace);                       \
  m.impl("all_gather_into_tensor", &allGatherIntoTensor);        \
  m.impl("reduce_scatter_tensor", &reduceScatterTensor);         \
  m.impl("all_to_all_single", &allToAllSingle);                  \
  m.impl("all_gather_into_tensor_out", &allGatherIntoTensorOut); \
  m.impl("reduce_scatter_tensor_out", &reduceScatterTensorOut);  \
  m.impl("all_to_all_single_out", &allToAllSingleOut)

namespace {

// The operators that return a new tensor (refuseGradient's), those that write one in place
// (writeInPlace's), and all of them.
constexpr const char* kReturningNew[] = {"all_reduce", "all_gather_into_tensor",
                                         "reduce_scatter_tensor", "all_to_all_single"};
constexpr const char* kInPlace[] = {"all_reduce_", "broadcast_", "all_gather_into_tensor_out",
                                    "reduce_scatter_tensor_out", "all_to_all_single_out"};
constexpr const char* kEvery[] = {"all_reduce_",
                                  "all_reduce",
                                  "broadcast_",
                                  "all_gather_into_tensor",
                                  "reduce_scatter_tensor",
                                  "all_to_all_single",
                                  "all_gather_into_tensor_out",
                                  "reduce_scatter_tensor_out",
                                  "all_to_all_single_out"};

/// Registers the boxed `kernel` for each operator of `names`.
template <auto kernel>
void implementBoxed(torch::Library& m, std::span<const char* const> names) {
  for (const char* name : names) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<kernel>());
  }
}

}  // namespace

// The boxed `kernel` for each operator of `names` under dispatch key `key`.
#define LOOM_BOXED(key, kernel, names) \
  TORCH_LIBRARY_IMPL(loom, key, m) {   \
    implementBoxed<kernel>(m, names);  \
  }

LOOM_BOXED(Autograd, &refuseGradient, kReturningNew)
LOOM_BOXED(Autograd, &writeInPlace, kInPlace)
LOOM_BOXED(Negative, &resolveMathBits, kEvery)
LOOM_BOXED(Conjugate, &resolveMathBits, kEvery)
LOOM_BOXED(SparseCPU, &refuseSparse, kEvery)
LOOM_BOXED(SparseCUDA, &refuseSparse, kEvery)
LOOM_BOXED(SparseCsrCPU, &refuseSparse, kEvery)
LOOM_BOXED(SparseCsrCUDA, &refuseSparse, kEvery)

TORCH_LIBRARY_IMPL(loom, CPU, m) {
  LOOM_DIRECT_OPS(m);
}
TORCH_LIBRARY_IMPL(loom, CUDA, m) {
  LOOM_DIRECT_OPS(m);
}

}  // namespace loom::torch_plugin
