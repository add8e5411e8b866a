// A sparse COO all_reduce (the sum torch's sparse gradients need): every rank's entries
// gathered, then added by coalesce(). Only each rank knows its entry count, so the gather of
// the counts comes first and the entries' gathers are placed as they start
// (Communicator::allGatherVPlaced): all three are issued at once, in order, and an
// asynchronous call returns without waiting for any of them, as every other call does.

#include <memory>
#include <vector>

#include "launch.h"

namespace loom::torch_plugin {

namespace {

// What a rank's sparse all_reduce exchanges before its gather: its entry count, and what every
// rank's tensor must share (dtype, sparse and dense dimensions, shape), so that ranks that
// disagree all refuse instead of gathering rows of different widths into tensors that do
// not hold them.
struct SparseRecord {
  static constexpr size_t kShown = 8;  // sizes carried as they are (more: only the hash)
  int64_t nnz = 0;
  int64_t dtype = 0;
  int64_t sparseDim = 0;
  int64_t denseDim = 0;
  int64_t dims = 0;
  int64_t shapeHash = 0;  // FNV-1a over every size
  int64_t sizes[kShown] = {};

  static SparseRecord of(const at::Tensor& coalesced) {
    SparseRecord r;
    r.nnz = coalesced._nnz();
    r.dtype = static_cast<int64_t>(coalesced.scalar_type());
    r.sparseDim = coalesced.sparse_dim();
    r.denseDim = coalesced.dense_dim();
    r.dims = coalesced.dim();
    uint64_t hash = 1469598103934665603ull;
    for (int64_t d = 0; d < r.dims; ++d) {
      const int64_t size = coalesced.size(d);
      if (static_cast<size_t>(d) < kShown) r.sizes[d] = size;
      hash = (hash ^ static_cast<uint64_t>(size)) * 1099511628211ull;
    }
    r.shapeHash = static_cast<int64_t>(hash);
    return r;
  }
  bool agreesWith(const SparseRecord& o) const {
    return dtype == o.dtype && sparseDim == o.sparseDim && denseDim == o.denseDim &&
           dims == o.dims && shapeHash == o.shapeHash;
  }
  // "float32 of shape [3, 4] (2 sparse dimensions, 0 dense)".
  std::string describe() const {
    std::string shape = "[";
    for (int64_t d = 0; d < dims && static_cast<size_t>(d) < kShown; ++d) {
      shape += (d > 0 ? ", " : "") + std::to_string(sizes[d]);
    }
    if (static_cast<size_t>(dims) > kShown) shape += ", ...";
    return std::string(c10::toString(static_cast<at::ScalarType>(dtype))) + " of shape " + shape +
           "] (" + std::to_string(sparseDim) + " sparse dimensions, " + std::to_string(denseDim) +
           " dense)";
  }
};
static_assert(sizeof(SparseRecord) % sizeof(int64_t) == 0);

// What the three calls of one rank's sparse all_reduce share: its record and entries, every
// rank's records (the count exchange's output), and the gathered entries, made when the
// first entries' gather starts.
struct SparseGather {
  SparseRecord mine;
  std::vector<SparseRecord> records;
  at::Tensor rowsIn;  // this rank's indices as [nnz, sparse dims] rows
  at::Tensor values;  // this rank's values, [nnz, dense sizes...]
  at::Tensor rowsOut;
  at::Tensor allValues;

  // Every rank passed what rank 0 passed (all ranks see the same records, so all agree).
  bool agreed() const {
    for (const SparseRecord& r : records) {
      if (!r.agreesWith(records[0])) return false;
    }
    return true;
  }
  // Where every rank's rows (of `rowBytes` bytes each) go in `out`, rank after rank: nowhere
  // where the ranks disagree (every rank gathers nothing; the call's finisher says why).
  Communicator::Placement place(const at::Tensor& out, size_t rowBytes) const {
    Communicator::Placement p;
    const bool agree = agreed();
    int64_t offset = 0;
    for (const SparseRecord& r : records) {
      const int64_t rows = agree ? r.nnz : 0;
      p.outputs.push_back(rows == 0 ? nullptr
                                    : static_cast<uint8_t*>(out.data_ptr()) + offset * rowBytes);
      p.counts.push_back(static_cast<size_t>(rows) * rowBytes);
      offset += rows;
    }
    return p;
  }
  // Makes the tensors that receive every rank's rows (on the thread that runs the gathers).
  void makeOutputs() {
    int64_t total = 0;
    if (agreed()) {
      for (const SparseRecord& r : records) total += r.nnz;
    }
    rowsOut = at::empty({total, rowsIn.size(1)}, rowsIn.options());
    std::vector<int64_t> shape = values.sizes().vec();
    shape[0] = total;
    allValues = at::empty(shape, values.options());
  }
  size_t indexRowBytes() const { return static_cast<size_t>(rowsIn.size(1)) * sizeof(int64_t); }
  size_t valueRowBytes() const {
    size_t row = static_cast<size_t>(values.element_size());
    for (int64_t d = 1; d < values.dim(); ++d) row *= static_cast<size_t>(values.size(d));
    return row;
  }
};

}  // namespace

c10::intrusive_ptr<c10d::Work> ProcessGroupLoom::allreduceSparse(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) {
  const CallSite s = site("all_reduce (sparse)");
  const at::Tensor& t = tensors[0];
  if (!t.device().is_cpu())
    invalid(s, "the sparse tensor is on " + t.device().str() + "; loom handles CPU tensors");
  if (static_cast<c10d::ReduceOp::RedOpType>(opts.reduceOp) != c10d::ReduceOp::SUM) {
    invalid(s, "sparse tensors can only be summed");
  }
  auto g = std::make_shared<SparseGather>();
  const at::Tensor local = t.coalesce();
  g->mine = SparseRecord::of(local);
  g->records.resize(static_cast<size_t>(size_));
  g->rowsIn = local.indices().t().contiguous();
  g->values = local.values().contiguous();
  at::Tensor output = t;
  // The finisher's refusal carries the legend as it reads now: it may run after the group
  // is gone.
  CallSite later = s;
  later.legend = nullptr;
  const std::string legend = ties_->legend;
  // Runs once the gathers have: a disagreement among the records fails every rank alike
  // (they all read the same records), else the sum is written into the caller's tensor.
  auto finisher = [g, output, later, legend]() mutable {
    for (size_t q = 0; q < g->records.size(); ++q) {
      if (!g->records[q].agreesWith(g->records[0])) {
        invalid(later, "rank " + std::to_string(q) + " passed a sparse tensor " +
                           g->records[q].describe() + " where rank 0 passed " +
                           g->records[0].describe() +
                           "; every rank must pass the same dtype and shape" + legend);
      }
    }
    auto summed = at::sparse_coo_tensor(g->rowsOut.t(), g->allValues, output.sizes()).coalesce();
    writeResult(output, summed);
  };
  return launch(
      s, c10d::OpType::ALLREDUCE, "loom:all_reduce", tensors, tensors, finisher, [&](Requests& r) {
        // Inside launch, which sets what opOptions reads (the desync-debug signature).
        const OpOptions options = opOptions(opts.timeout, !opts.asyncOp);
        r.push_back(comm_->allGather(&g->mine, g->records.data(),
                                     sizeof(SparseRecord) / sizeof(int64_t), DataType::kInt64,
                                     options));
        r.push_back(comm_->allGatherVPlaced(
            g->rowsIn.data_ptr(),
            [g] {
              g->makeOutputs();
              return g->place(g->rowsOut, g->indexRowBytes());
            },
            DataType::kUInt8, options));
        r.push_back(comm_->allGatherVPlaced(
            g->values.data_ptr(), [g] { return g->place(g->allValues, g->valueRowBytes()); },
            DataType::kUInt8, options));
      });
}

}  // namespace loom::torch_plugin
