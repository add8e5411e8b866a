// Tensor checks, dtype mapping and staging.

#include "tensor_args.h"

#include <ATen/MemoryOverlap.h>

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <span>
#include <utility>

namespace loom::torch_plugin {

namespace {

std::optional<DataType> loomType(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kChar: return DataType::kInt8;
    case at::kByte: return DataType::kUInt8;
    case at::kShort: return DataType::kInt16;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kBool: return DataType::kBool;
    default: return std::nullopt;
  }
}

// Named here rather than with operator<< (see invalid()).
std::string layoutName(at::Layout layout) {
  switch (layout) {
    case at::kStrided: return "strided";
    case at::kSparse: return "sparse COO";
    case at::kSparseCsr: return "sparse CSR";
    case at::kSparseCsc: return "sparse CSC";
    case at::kSparseBsr: return "sparse BSR";
    case at::kSparseBsc: return "sparse BSC";
    case at::kMkldnn: return "mkldnn";
    case at::kJagged: return "jagged";
    default: return "other";
  }
}

}  // namespace

void invalid(const CallSite& site, const std::string& detail) {
  // One ready string: TORCH_CHECK formats several arguments through an ostringstream, which
  // crashed inside this extension on torch 2.11 built with the device hosts' GCC 13.
  const std::string message = "loom " + std::string(site.op) + " (rank " +
                              std::to_string(site.rank) + "): " + detail +
                              (site.legend != nullptr ? *site.legend : std::string());
  TORCH_CHECK(false, message);
}

void requireCount(const CallSite& site, const char* what, size_t actual, size_t n) {
  if (actual != n) {
    invalid(site, std::string(what) + " has " + std::to_string(actual) + " tensor(s); expected " +
                      std::to_string(n));
  }
}

void requireOne(const CallSite& site, const char* what, size_t actual) {
  if (actual == 1) return;
  std::string message =
      std::string(what) + " has " + std::to_string(actual) + " entries; expected 1";
  // The list forms of the backend's methods date from one entry per GPU of a process, which
  // NCCL's backend refuses too; torch.distributed passes one.
  if (actual > 1) {
    message +=
        " (loom takes one per call: issue one call for each, or group the calls in "
        "torch.distributed._coalescing_manager)";
  }
  invalid(site, message);
}

void requireDense(const CallSite& site, const char* what, const at::Tensor& t) {
  if (!t.defined()) invalid(site, std::string(what) + " is an undefined tensor");
  if (!t.device().is_cpu() && !t.device().is_cuda()) {
    invalid(site, std::string(what) + " is on " + t.device().str() +
                      "; the loom backend takes CPU and CUDA tensors");
  }
  if (t.layout() != at::kStrided) {
    invalid(site, std::string(what) + " is not a dense tensor (layout " + layoutName(t.layout()) +
                      "); loom moves dense tensors only");
  }
}

void requireWholeOfParts(const CallSite& site, const std::string& wholeName,
                         const at::Tensor& whole, const std::string& partName,
                         const at::Tensor& part) {
  requireDense(site, partName.c_str(), part);
  requireDense(site, wholeName.c_str(), whole);
  if (whole.scalar_type() != part.scalar_type()) {
    invalid(site, wholeName + " is " + dtypeName(whole) + " but " + partName + " is " +
                      dtypeName(part) + "; give both one dtype");
  }
  const int64_t needed = part.numel() * site.size;
  if (whole.numel() != needed) {
    invalid(site, wholeName + " has " + std::to_string(whole.numel()) +
                      " elements; it needs size x " + partName + " = " + std::to_string(needed));
  }
}

void requireLike(const CallSite& site, const char* what, const std::vector<at::Tensor>& list,
                 const char* likeName, const at::Tensor& like) {
  for (size_t i = 0; i < list.size(); ++i) {
    requireDense(site, what, list[i]);
    if (list[i].scalar_type() != like.scalar_type()) {
      invalid(site, std::string(what) + "[" + std::to_string(i) + "] has dtype " +
                        c10::toString(list[i].scalar_type()) + " but " + likeName + " has " +
                        c10::toString(like.scalar_type()) +
                        "; all tensors of one call must share a dtype");
    }
    if (list[i].numel() != like.numel()) {
      invalid(site, std::string(what) + "[" + std::to_string(i) + "] has " +
                        std::to_string(list[i].numel()) + " elements but " + likeName + " has " +
                        std::to_string(like.numel()));
    }
  }
}

namespace {

thread_local std::vector<at::Tensor> tStaged;           // noteStaged's, until takeStaged
thread_local const EarlierCalls* tPreparing = nullptr;  // prepareCallOf's

}  // namespace

void prepareCallOf(const EarlierCalls* group) {
  tPreparing = group;
}

void forgetPreparing(const EarlierCalls* group) {
  if (tPreparing == group) tPreparing = nullptr;
}

void settleBeforeCopying(const at::Tensor& read) {
  if (tPreparing != nullptr) tPreparing->settle(read);
}

void noteStaged(const at::Tensor& copy) {
  if (copy.defined() && copy.is_cuda()) tStaged.push_back(copy);
}

std::vector<at::Tensor> takeStaged() {
  return std::exchange(tStaged, {});
}

void discardStaged() {
  if (!tStaged.empty()) tStaged.clear();
}

Flat reductionView(const CallSite& site, const at::Tensor& t, const c10d::ReduceOp& op) {
  if (t.is_complex()) {
    const auto kind = static_cast<c10d::ReduceOp::RedOpType>(op);
    if (kind != c10d::ReduceOp::SUM && kind != c10d::ReduceOp::AVG &&
        kind != c10d::ReduceOp::PREMUL_SUM) {
      invalid(site, "complex tensors can be reduced with SUM, AVG or PREMUL_SUM only");
    }
    return movementView(t);
  }
  const auto type = loomType(t.scalar_type());
  if (!type) {
    invalid(site, "dtype " + std::string(c10::toString(t.scalar_type())) +
                      " cannot be reduced by loom (supported: float32, float64, float16, bfloat16, "
                      "int8, uint8, int16, int32, int64, bool and complex as real pairs)");
  }
  if (!t.is_contiguous()) settleBeforeCopying(t);
  const at::Tensor data = t.contiguous();
  if (!data.is_alias_of(t)) noteStaged(data);
  return Flat{data, t, *type, static_cast<size_t>(data.numel())};
}

Flat movementView(const at::Tensor& t) {
  // A conjugate view has no real view: loom works on a resolved copy, which is staged and
  // copied back into `t` itself (Outputs::inOut), conjugating on the way.
  const at::Tensor view = t.is_complex() && !t.is_conj() ? at::view_as_real(t) : t;
  if (t.is_conj() || !view.is_contiguous()) settleBeforeCopying(t);
  const at::Tensor data = (t.is_conj() ? at::view_as_real(t.resolve_conj()) : view).contiguous();
  if (!data.is_alias_of(t)) noteStaged(data);
  const auto type = loomType(data.scalar_type()).value_or(DataType::kUInt8);
  return Flat{data, view, type, elementsOf(data, type)};
}

bool overlap(const void* a, size_t na, const void* b, size_t nb) {
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  return na > 0 && nb > 0 && x < y + nb && y < x + na;
}

namespace {

// `in`, or a copy of it where it overlaps the `outBytes` at `out` and is not in place.
Flat readApart(const Flat& in, const void* out, size_t outBytes, bool inPlace) {
  if (!overlap(in.ptr(), in.data.nbytes(), out, outBytes) || inPlace) return in;
  settleBeforeCopying(in.data);
  const at::Tensor copy = in.data.clone();
  noteStaged(copy);
  return Flat{copy, in.view, in.type, in.count};
}

}  // namespace

Flat listGatherReadApart(const CallSite& site, const Flat& in,
                         const std::vector<at::Tensor>& outputs) {
  for (size_t q = 0; q < outputs.size(); ++q) {
    const bool inPlace = static_cast<int>(q) == site.rank && outputs[q].data_ptr() == in.ptr() &&
                         outputs[q].nbytes() == in.data.nbytes();
    const Flat apart = readApart(in, outputs[q].data_ptr(), outputs[q].nbytes(), inPlace);
    if (apart.data.data_ptr() != in.ptr()) return apart;
  }
  return in;
}

void listScatterReadApart(const CallSite& site, std::vector<Flat>& ins, const at::Tensor& output) {
  for (size_t q = 0; q < ins.size(); ++q) {
    const bool inPlace = static_cast<int>(q) == site.rank && ins[q].ptr() == output.data_ptr() &&
                         ins[q].data.nbytes() == output.nbytes();
    ins[q] = readApart(ins[q], output.data_ptr(), output.nbytes(), inPlace);
  }
}

Flat allToAllReadApart(const Flat& in, const at::Tensor& output, bool inPlace) {
  const bool same = in.ptr() == output.data_ptr() && in.data.nbytes() == output.nbytes();
  return readApart(in, output.data_ptr(), output.nbytes(), inPlace && same);
}

void allToAllReadApart(std::vector<Flat>& ins, const std::vector<at::Tensor>& outputs) {
  for (Flat& in : ins) {
    for (const at::Tensor& output : outputs) {
      const Flat apart = readApart(in, output.data_ptr(), output.nbytes(), false);
      if (apart.data.data_ptr() != in.data.data_ptr()) {
        in = apart;
        break;
      }
    }
  }
}

namespace {

// readApartAcrossPairs over `pairs` pairs whose outputs `outputsOf(j)` gives as a span.
template <class OutputsOf>
void readApartAcrossPairsOf(std::vector<Flat>& ins, size_t pairs, OutputsOf outputsOf) {
  for (size_t i = 0; i < ins.size(); ++i) {
    bool copied = false;
    for (size_t j = 0; j < pairs && !copied; ++j) {
      if (j == i) continue;  // its own outputs: gatherReadApart / scatterReadApart
      for (const at::Tensor& out : outputsOf(j)) {
        const Flat apart = readApart(ins[i], out.data_ptr(), out.nbytes(), false);
        if (apart.data.data_ptr() != ins[i].data.data_ptr()) {
          ins[i] = apart;
          copied = true;
          break;
        }
      }
    }
  }
}

}  // namespace

void readApartAcrossPairs(std::vector<Flat>& ins, const std::vector<at::Tensor>& outputs) {
  readApartAcrossPairsOf(ins, outputs.size(),
                         [&](size_t j) { return std::span<const at::Tensor>(&outputs[j], 1); });
}

void readApartAcrossPairs(std::vector<Flat>& ins,
                          const std::vector<std::vector<at::Tensor>>& outputsByPair) {
  readApartAcrossPairsOf(ins, outputsByPair.size(),
                         [&](size_t j) { return std::span<const at::Tensor>(outputsByPair[j]); });
}

Flat gatherReadApart(const CallSite& site, const Flat& in, const at::Tensor& output) {
  const auto* own = static_cast<const uint8_t*>(output.data_ptr()) +
                    static_cast<size_t>(site.rank) * in.data.nbytes();
  return readApart(in, output.data_ptr(), output.nbytes(), in.ptr() == own);
}

Flat scatterReadApart(const CallSite& site, const Flat& in, const at::Tensor& output) {
  const auto* own =
      static_cast<const uint8_t*>(in.ptr()) + static_cast<size_t>(site.rank) * output.nbytes();
  return readApart(in, output.data_ptr(), output.nbytes(), output.data_ptr() == own);
}

void writeResult(const at::Tensor& original, const at::Tensor& values) {
  // Below autograd and in-place/view tracking: a Parameter that requires grad and an inference
  // tensor take a collective's result as Gloo writes it, whatever the grad or inference mode
  // of the thread that finishes the call (loom's worker, for an asynchronous one). copy_ alone
  // refused them (leaf that requires grad, inference tensor outside InferenceMode).
  const at::AutoDispatchBelowADInplaceOrView raw;
  original.copy_(values);
}

void copyBackInto(const at::Tensor& original, const at::Tensor& scratch) {
  if (original.is_complex() && !scratch.is_complex()) {
    writeResult(original, at::view_as_complex(scratch));  // a conjugate view's resolved copy
  } else {
    writeResult(original, scratch);
  }
}

size_t elementsOf(const at::Tensor& t, DataType type) {
  return t.nbytes() / elementSize(type);
}

ReduceOp reduceOpOf(const CallSite& site, const c10d::ReduceOp& op, const Flat& data) {
  const DataType type = data.type;
  ReduceOp result;
  switch (static_cast<c10d::ReduceOp::RedOpType>(op)) {
    case c10d::ReduceOp::SUM: result = ReduceKind::kSum; break;
    case c10d::ReduceOp::AVG: result = ReduceKind::kAvg; break;
    case c10d::ReduceOp::PRODUCT: result = ReduceKind::kProduct; break;
    case c10d::ReduceOp::MIN: result = ReduceKind::kMin; break;
    case c10d::ReduceOp::MAX: result = ReduceKind::kMax; break;
    case c10d::ReduceOp::BAND: result = ReduceKind::kBitAnd; break;
    case c10d::ReduceOp::BOR: result = ReduceKind::kBitOr; break;
    case c10d::ReduceOp::BXOR: result = ReduceKind::kBitXor; break;
    case c10d::ReduceOp::PREMUL_SUM: {
      const auto* supplement =
          dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      if (supplement == nullptr) {
        invalid(site,
                "PREMUL_SUM came without its factor; make the op with "
                "torch.distributed._make_nccl_premul_sum(factor)");
      }
      if (supplement->tensor_factor.defined() && supplement->tensor_factor.is_complex()) {
        // Taking its real part (what .to(kDouble) does, with only a warning) would be a
        // wrong answer: the real pairs of a complex tensor cannot be scaled by i.
        invalid(site, "PREMUL_SUM's factor is complex (" +
                          std::string(c10::toString(supplement->tensor_factor.scalar_type())) +
                          "); loom scales by a real factor: pass a real one, or multiply the "
                          "tensor before an all_reduce with SUM");
      }
      const at::Tensor& given = supplement->tensor_factor;
      if (!given.defined()) {
        result = ReduceOp::premulSum(supplement->double_factor);
        break;
      }
      if (given.is_cuda() && data.data.is_cuda()) {
        // Read by the kernels when the call runs, never by the host here: .item() would make
        // the host wait for the caller's stream, and would end a CUDA graph capture. A copy,
        // queued on the caller's stream (which the call's stream follows), even of a float64
        // factor on this GPU already: every step of the call reads the value the factor had
        // when the call was issued, whatever the caller writes into it meanwhile.
        const at::Tensor onDevice =
            given.to(data.data.device(), at::kDouble, /*non_blocking=*/false, /*copy=*/true)
                .reshape({});
        noteStaged(onDevice);  // kept until the call's stream is past it
        result = ReduceOp::premulSumOnDevice(onDevice.const_data_ptr<double>());
        break;
      }
      result = ReduceOp::premulSum(given.to(at::kDouble).item<double>());
      break;
    }
    default: invalid(site, "unknown reduce op " + std::to_string(static_cast<int>(op.op_)));
  }
  if (!isSupported(result.kind(), type)) {
    invalid(site, std::string(reduceKindName(result.kind())) + " is not defined for " +
                      std::string(dataTypeName(type)) + " tensors");
  }
  return result;
}

at::Tensor Outputs::target(const at::Tensor& t, bool keep) {
  if (t.is_contiguous() && !t.is_conj()) return t;
  at::Tensor staged = scratch(t);
  if (keep) {
    settleBeforeCopying(t);
    staged.copy_(t);  // t's values (a conjugate view's resolved)
  }
  return staged;
}

void Outputs::requireOwnElements(const at::Tensor& t) const {
  if (at::has_internal_overlap(t) == at::MemOverlap::Yes) {
    invalid(site_,
            "an output of the call has elements that share memory (a stride of 0, as expand() "
            "makes), so several results would land in one place; pass a tensor whose elements "
            "are its own (clone() it, or make it with torch.empty)");
  }
}

at::Tensor Outputs::scratch(const at::Tensor& t) {
  requireOwnElements(t);
  at::Tensor made = at::empty_like(t, at::MemoryFormat::Contiguous);
  noteStaged(made);
  staged_.emplace_back(made, t);
  return made;
}

size_t spanBytes(const at::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * std::abs(t.stride(d));
  return static_cast<size_t>(last + 1) * t.element_size();
}

std::vector<at::Tensor> Outputs::targets(const std::vector<at::Tensor>& outputs) {
  std::vector<bool> clashes(outputs.size(), false);
  for (size_t q = 0; q < outputs.size(); ++q) {
    for (size_t j = q + 1; j < outputs.size(); ++j) {
      if (overlap(outputs[q].data_ptr(), spanBytes(outputs[q]), outputs[j].data_ptr(),
                  spanBytes(outputs[j]))) {
        clashes[q] = clashes[j] = true;
      }
    }
  }
  std::vector<at::Tensor> out;
  for (size_t q = 0; q < outputs.size(); ++q) {
    out.push_back(clashes[q] ? scratch(outputs[q]) : target(outputs[q]));
  }
  return out;
}

void Outputs::inOut(const Flat& flat) {
  if (flat.data.is_alias_of(flat.view)) return;
  requireOwnElements(flat.view);
  staged_.emplace_back(flat.data, flat.view);
}

void Outputs::finish() {
  for (auto& [scratch, original] : staged_) copyBackInto(original, scratch);
  staged_.clear();
}

std::function<void()> copyBack(Outputs outputs) {
  if (!outputs.staged()) return nullptr;
  return [o = std::make_shared<Outputs>(std::move(outputs))] { o->finish(); };
}

std::function<void()> copyBack(Outputs outputs, const Flat& read) {
  if (read.data.is_alias_of(read.view)) return copyBack(std::move(outputs));
  // `copy` is held, not used: the engine reads it until the finisher runs.
  return [o = std::make_shared<Outputs>(std::move(outputs)), copy = read.data] { o->finish(); };
}

}  // namespace loom::torch_plugin
