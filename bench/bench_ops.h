#pragma once

// The operations loom-bench times, with nccl-tests' size conventions and bus-bandwidth
// factors, the memory-traffic model of loom's algorithm for each (for the roofline column),
// and a check of each result against the reference.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "algorithms/collective.h"
#include "algorithms/selection.h"
#include "lendable_buffer.h"
#include "loom/communicator.h"

namespace loom::bench {

enum class BenchOp {
  kAllReduce,
  kAllGather,
  kReduceScatter,
  kBroadcast,
  kAllToAll,
  kReduce,
  kGather,
  kScatter
};

/// "all_reduce", ...
std::string_view opName(BenchOp op);
/// Parses an op name; nullopt if unknown.
std::optional<BenchOp> parseOp(std::string_view name);
/// The engine's collective behind `op`.
CollectiveKind collectiveOf(BenchOp op);

/// busbw = algbw x busFactor (nccl-tests): 2(P-1)/P for all_reduce, (P-1)/P for all_gather,
/// reduce_scatter and all_to_all, 1 for the rooted ones.
double busFactor(BenchOp op, int ranks);

/// Bytes loom moves through memory (read + written, all ranks together) per byte of the
/// message, for the algorithm it picks at this size: the k in "roofline = k N / t / copy bw".
double trafficFactor(BenchOp op, int ranks, size_t bytes, const SelectionTable& table);

/// The DRAM model's k: bytes each rank must read (its input) and write (its output) once,
/// all ranks together, per byte of the message (nccl-tests sizes): 2P for all_reduce and
/// all_to_all, P + 1 for all_gather, reduce_scatter, broadcast and reduce, 2 for gather and
/// scatter. "dram = k N / t / copy bw" is what a copy-free algorithm could reach.
double dramFactor(BenchOp op, int ranks);

/// One operation's buffers at one size, filled with the reference inputs.
class OpCase {
 public:
  /// `bytes` follows nccl-tests: the whole buffer (all_reduce, broadcast, reduce), the
  /// whole output (all_gather, gather), the whole input (reduce_scatter, scatter), the
  /// per-rank buffer (all_to_all). `lent`: buffers from the lending pool.
  OpCase(Communicator& comm, BenchOp op, DataType type, ReduceOp reduce, size_t bytes, bool inPlace,
         bool lent = false);
  /// Starts the operation once.
  Request launch();
  /// Elements that differ from the reference (all of them up to 1M elements, else three
  /// windows of 4096 at the start, middle and end).
  size_t wrong(uint32_t salt);
  /// Refills the inputs (every rank its own data) and marks the output unwritten, for a
  /// correctness run with `salt` (timing runs reuse old contents).
  void refill(uint32_t salt);
  /// The size actually used, after rounding to whole elements per rank.
  size_t bytes() const { return bytes_; }
  size_t count() const { return count_; }

 private:
  Communicator& comm_;
  BenchOp op_;
  DataType type_;
  ReduceOp reduce_;
  bool inPlace_;
  size_t count_ = 0;  // elements per rank block (or the whole buffer, see the constructor)
  size_t bytes_ = 0;
  testing::LendableBuffer input_;
  testing::LendableBuffer output_;
  std::vector<const void*> inputs_;
  std::vector<void*> outputs_;
  uint8_t* in_ = nullptr;
  uint8_t* out_ = nullptr;
};

}  // namespace loom::bench
