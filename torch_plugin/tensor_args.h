#pragma once

// Turning c10d's tensors and options into loom's pointers, counts, types and reductions,
// with the checks that make bad input a clear error before anything is sent. Tensors that
// loom cannot use as they are (non-contiguous, complex, conjugate views) are staged: inputs
// are copied to a contiguous (real-viewed) tensor; outputs get a contiguous scratch tensor
// that is copied back once the operation completes.

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <functional>
#include <string>
#include <vector>

#include "loom/types.h"

namespace loom::torch_plugin {

/// Where a call happens, for messages.
struct CallSite {
  const char* op;
  int rank;
  int size;
  bool blocking = false;  ///< async_op=False: the caller waits for the call
  /// What the group's messages end with (which global ranks its ranks are; empty for the
  /// world), or null: the group outlives the call.
  const std::string* legend = nullptr;
  /// The call writes its outputs; false for a broadcast's root and a reduce's non-roots,
  /// which only read theirs (later calls that copy those bytes need not wait for it).
  bool writes = true;
};

/// Throws c10::Error (RuntimeError in Python) "loom <op> (rank r): <detail>", then the legend.
[[noreturn]] void invalid(const CallSite& site, const std::string& detail);
/// Whether `na` bytes at `a` and `nb` bytes at `b` share any.
bool overlap(const void* a, size_t na, const void* b, size_t nb);
/// The bytes from `t`'s first element to just past its last, whatever its strides.
size_t spanBytes(const at::Tensor& t);
/// A tensor's dtype as torch prints it ("Float", "BFloat16"), for messages.
inline std::string dtypeName(const at::Tensor& t) {
  return c10::toString(t.scalar_type());
}

/// Checks the argument list has exactly `n` tensors (c10d passes single-element lists).
void requireCount(const CallSite& site, const char* what, size_t actual, size_t n);
/// Refuses a list that holds other than one entry (the per-device list forms), saying what to
/// do instead.
void requireOne(const CallSite& site, const char* what, size_t actual);

/// Checks `t` is a dense CPU or CUDA tensor; `what` names the argument. (That all tensors
/// of a call share one device is checked when it is launched.)
void requireDense(const CallSite& site, const char* what, const at::Tensor& t);

/// Checks the pair of an into-one-tensor collective: `whole` and `part` are dense
/// tensors of one dtype and `whole` holds `size` x `part`'s elements.
void requireWholeOfParts(const CallSite& site, const std::string& wholeName,
                         const at::Tensor& whole, const std::string& partName,
                         const at::Tensor& part);

/// Checks every tensor in `list` has the dtype and number of elements of `like`, which the
/// messages call `likeName` ("the input").
void requireLike(const CallSite& site, const char* what, const std::vector<at::Tensor>& list,
                 const char* likeName, const at::Tensor& like);

/// loom's view of one tensor: a contiguous tensor (the original, its real view, or a staged
/// copy of either), its loom element type and element count. `view` is the memory the caller
/// means (the tensor, its real view, or a conjugate view itself); when `data` is a copy,
/// results written to it must be copied back to `view` (copyBackInto).
struct Flat {
  at::Tensor data;
  at::Tensor view;
  DataType type;
  size_t count;
  void* ptr() const { return data.data_ptr(); }
};

/// Notes `copy`, made for the call being prepared on this thread in place of a caller's
/// tensor, if it is a CUDA tensor (staged inputs, output scratch, packed lists).
void noteStaged(const at::Tensor& copy);
/// Takes the CUDA copies noted on this thread since the last take. They were allocated on
/// the caller's current stream, but the call's kernels (the collective, the copy-back) may
/// run on the loom stream: launch() records them there, so that the caching allocator
/// reuses their memory only once those kernels are done with it, whenever the host lets go.
std::vector<at::Tensor> takeStaged();
/// Forgets them: every call starts with none (ProcessGroupLoom::site).
void discardStaged();

/// A group whose earlier calls a copy taken at issue time must wait for (ProcessGroupLoom).
class EarlierCalls {
 public:
  /// Returns once this group's asynchronous calls on CPU tensors that write `read`'s storage
  /// have ended, their results copied back into it.
  virtual void settle(const at::Tensor& read) const = 0;

 protected:
  ~EarlierCalls() = default;
};
/// The group preparing a call on this thread (ProcessGroupLoom::site sets it for each call).
void prepareCallOf(const EarlierCalls* group);
/// Clears this thread's mark if it is `group` (a group being destroyed).
void forgetPreparing(const EarlierCalls* group);
/// Before a copy of the caller's tensor `read` taken as the call is prepared (staging a
/// non-contiguous tensor, packing a list): the calls issued before it run later, on loom's
/// thread, and one of them may still have to write that tensor (a staged call copies its
/// result back only as it ends); this waits for those, so the copy reads what the calls
/// before it leave there, as the collective itself would. Calls that write other tensors
/// are not waited for: a later call must not wait on one a peer can finish only after it.
void settleBeforeCopying(const at::Tensor& read);

/// For reductions: complex tensors as their real view (SUM, AVG and PREMUL_SUM only),
/// other dtypes as themselves; throws for dtypes loom cannot reduce.
Flat reductionView(const CallSite& site, const at::Tensor& t, const c10d::ReduceOp& op);

/// For data movement: the tensor as loom's element type (complex as real pairs), or as
/// bytes for dtypes loom does not know (float8, unsigned 16-64 bit, ...): movement does not
/// care, and a known type makes mismatches across ranks readable and detectable.
Flat movementView(const at::Tensor& t);

/// `in` (an all_gather's input) as the engine may read it beside `output`: a copy where it
/// overlaps `output` other than as this rank's own block (in place). The engine refuses
/// overlapping buffers only on the ranks where they overlap, which would leave the other
/// ranks waiting in the collective; Gloo reads such an input as it was.
Flat gatherReadApart(const CallSite& site, const Flat& in, const at::Tensor& output);

/// The same for a reduce_scatter's input beside its `output` (in place: `output` is this
/// rank's block of the input).
Flat scatterReadApart(const CallSite& site, const Flat& in, const at::Tensor& output);

/// The list forms (all_gather and gather into a list, reduce_scatter and scatter from one):
/// `in` as the engine may read it beside every one of `outputs`, a copy where it overlaps
/// any but outputs[site.rank] being `in` itself (in place).
Flat listGatherReadApart(const CallSite& site, const Flat& in,
                         const std::vector<at::Tensor>& outputs);
/// Each of `ins` a copy where it overlaps `output`, but for ins[site.rank] being `output`.
void listScatterReadApart(const CallSite& site, std::vector<Flat>& ins, const at::Tensor& output);

/// An all_to_all's input as the engine may read it beside `output`, the buffer it writes: a
/// copy where the two overlap, unless the input is `output` itself and `inPlace` (the
/// equal-block form, which the engine runs in place). The engine refuses partly
/// overlapping buffers on that rank only, and its form with split sizes would read blocks
/// that peers had already overwritten; Gloo reads the input as it was.
Flat allToAllReadApart(const Flat& in, const at::Tensor& output, bool inPlace);
/// The list form: each of `ins` a copy where it overlaps any of `outputs` (what the engine
/// writes).
void allToAllReadApart(std::vector<Flat>& ins, const std::vector<at::Tensor>& outputs);

/// A coalesced call's inputs, each a copy where it overlaps another pair's output: the
/// engine runs the pairs one after another, so such an input would be read after an earlier
/// pair wrote it (Gloo reads every input first).
void readApartAcrossPairs(std::vector<Flat>& ins, const std::vector<at::Tensor>& outputs);
/// The same where each pair writes several outputs (all_gather_coalesced: one per rank).
void readApartAcrossPairs(std::vector<Flat>& ins,
                          const std::vector<std::vector<at::Tensor>>& outputsByPair);

/// original.copy_(values) as a collective's result: below autograd and in-place tracking, so
/// that a Parameter that requires grad or an inference tensor takes it on any thread.
void writeResult(const at::Tensor& original, const at::Tensor& values);
/// writeResult(original, scratch), where `scratch` may be the real pairs of a complex `original`.
void copyBackInto(const at::Tensor& original, const at::Tensor& scratch);

/// Elements of loom type `type` that tensor `t` holds.
size_t elementsOf(const at::Tensor& t, DataType type);

/// loom's reduction for c10d's over `data` (PREMUL_SUM factors included); throws if data's
/// type lacks it. A factor given as a CUDA tensor for CUDA data stays on the GPU: a double
/// copy of it, noted as staged (noteStaged), is what the kernels read.
ReduceOp reduceOpOf(const CallSite& site, const c10d::ReduceOp& op, const Flat& data);

/// Output tensors whose data loom writes: contiguous ones directly, others through scratch
/// tensors copied back by finish(). A staged one whose elements share memory (a stride of
/// 0, as expand() makes) is refused as it is staged, naming `site`: its copy-back would
/// fail only after the call had run on every rank.
class Outputs {
 public:
  explicit Outputs(const CallSite& site) : site_(site) {}

  /// A tensor loom can write into that ends up in `t` once finish() runs; with `keep`, one
  /// that starts with `t`'s values, for a call that may write only part of it (a recv).
  at::Tensor target(const at::Tensor& t, bool keep = false);
  /// Registers `flat` (an in-out buffer, as for all_reduce) for copy-back if it is staged.
  void inOut(const Flat& flat);
  /// target() of each of a list's `outputs`, but a scratch tensor for each that overlaps
  /// another (their memory, whatever their layout): the engine refuses outputs that overlap,
  /// on the ranks where they do, and Gloo writes them in order, later ones over earlier
  /// ones, as finish() copies these (staged in list order).
  std::vector<at::Tensor> targets(const std::vector<at::Tensor>& outputs);
  /// Copies scratch tensors back into their originals, in the order they were made.
  void finish();
  /// Whether any tensor is staged (finish() has work to do).
  bool staged() const { return !staged_.empty(); }

 private:
  // A contiguous scratch tensor for `t`, copied into it by finish().
  at::Tensor scratch(const at::Tensor& t);
  // Refuses `t` if its elements share memory.
  void requireOwnElements(const at::Tensor& t) const;
  CallSite site_;  // a copy: the legend it points to outlives the call
  std::vector<std::pair<at::Tensor, at::Tensor>> staged_;  // (scratch, original)
};

/// The finisher of an in-place call: copies `outputs`' staged tensors back, or nothing at all
/// (no finisher to allocate and run: the common, contiguous case) when none are staged.
/// A staged pair holds both its tensors, and an unstaged in-out tensor is the call's output,
/// which its Work holds: either way the memory loom uses outlives the call.
std::function<void()> copyBack(Outputs outputs);

/// The same for a call that also reads `read` (a flattened input): where `read` is the
/// caller's own memory (its Work holds the caller's inputs until done), copyBack(outputs);
/// where it is a copy, a finisher that also keeps the copy alive until the call is done.
std::function<void()> copyBack(Outputs outputs, const Flat& read);

}  // namespace loom::torch_plugin
