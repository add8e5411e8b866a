// Descriptors of CUDA calls: see cuda_descriptors.h.

#include "core/cuda_descriptors.h"

#include <cstdio>
#include <cstring>

namespace loom::detail {

namespace {

uint64_t word0(uint8_t what, DataType type, ReduceKind kind, bool variable, uint32_t rootOrTag) {
  return uint64_t{what} | uint64_t{static_cast<uint8_t>(type)} << 8 |
         uint64_t{static_cast<uint8_t>(kind)} << 16 | uint64_t{variable} << 24 |
         uint64_t{rootOrTag} << 32;
}

}  // namespace

cuda::Descriptor describe(const CollectiveArgs& args) {
  const CollectiveKind k = args.kind;
  const bool reduces = k == CollectiveKind::kAllReduce || k == CollectiveKind::kReduce ||
                       k == CollectiveKind::kReduceScatter;
  const bool rooted = k == CollectiveKind::kReduce || k == CollectiveKind::kBroadcast ||
                      k == CollectiveKind::kGather || k == CollectiveKind::kScatter;
  // A factor in device memory is the kernels' to write (cuda::Agreement::factorAt).
  uint64_t factorBits = 0;
  if (reduces && args.op.kind() == ReduceKind::kPremulSum && args.op.deviceFactor() == nullptr) {
    const double factor = args.op.factor();
    std::memcpy(&factorBits, &factor, sizeof factorBits);
  }
  return {{word0(static_cast<uint8_t>(k), args.type, reduces ? args.op.kind() : ReduceKind{},
                 args.variable, rooted ? static_cast<uint32_t>(args.root) : 0),
           (args.variable ? args.countsHash : args.count) & kCountMask, factorBits}};
}

cuda::Descriptor stepTagged(cuda::Descriptor d, uint64_t step) {
  d.words[1] = (d.words[1] & kCountMask) | step << kStepTagShift;
  return d;
}

bool staleStep(const cuda::Descriptor& mine, const cuda::Descriptor& theirs) {
  const auto what = static_cast<uint8_t>(mine.words[0]);
  if (what == kSendRecv || what == kAllToAllBlock) {
    // A pair's chunks agree up to the first that differs, which the receiver stops at: so its
    // number is the same on both ends, and another number is a chunk the sender's stopped
    // kernels never replaced (their flag still went up: a stream's flag write cannot look at
    // the abort word).
    return mine.words[2] != theirs.words[2];
  }
  // Ranks at the same step tag it alike, whatever they issued: another tag is a descriptor
  // left from another call, of any kind, size or path.
  return (mine.words[1] ^ theirs.words[1]) >> kStepTagShift != 0;
}

cuda::Descriptor describeChunk(const Transfer& t, uint8_t purpose, uint64_t chunk,
                               uint64_t sequence) {
  const uint64_t bytes = t.bytes & ((uint64_t{1} << kChunkShift) - 1);
  return {{word0(purpose, DataType{}, ReduceKind{}, false, static_cast<uint32_t>(t.tag)),
           bytes | chunk << kChunkShift, sequence}};
}

std::string explain(const cuda::Descriptor& d) {
  const uint64_t w0 = d.words[0];
  const auto what = static_cast<uint8_t>(w0);
  const bool transfer = what == kSendRecv || what == kAllToAllBlock;
  const uint64_t w1 = transfer ? d.words[1] : d.words[1] & kCountMask;  // without a step tag
  const auto high = static_cast<int32_t>(static_cast<uint32_t>(w0 >> 32));
  if (transfer) {
    const uint64_t bytes = w1 & ((uint64_t{1} << kChunkShift) - 1);
    const std::string size = std::to_string(bytes) + " bytes";
    return what == kAllToAllBlock
               ? "an all_to_all block of " + size
               : "a message with tag " + std::to_string(high) + " of " + size +
                     (w1 >> kChunkShift ? " (chunk " + std::to_string(w1 >> kChunkShift) + ")"
                                        : "");
  }
  const auto kind = static_cast<CollectiveKind>(what);
  const bool fused = (w0 & kFusedBit) != 0;
  const bool twoShot = fused && (w0 & kTwoShotBit) != 0;
  const bool chain = fused && (w0 & kChainBit) != 0;
  const uint64_t fusedBits = fused ? kTwoShotBit | kChainBit : 0;
  const auto root = static_cast<int32_t>(static_cast<uint32_t>((w0 & ~fusedBits) >> 32));
  const auto type = static_cast<DataType>(static_cast<uint8_t>(w0 >> 8));
  std::string text(collectiveName(kind));
  if (kind == CollectiveKind::kBarrier) return text;
  text += " of " + std::string(dataTypeName(type)) + ", ";
  if ((w0 >> 24) & 1) {
    char hash[32];
    std::snprintf(hash, sizeof hash, "%012llx", static_cast<unsigned long long>(w1));
    text += std::string("per-rank sizes with hash ") + hash;
  } else {
    text += std::to_string(w1) + " elements";
  }
  if (kind == CollectiveKind::kAllReduce || kind == CollectiveKind::kReduce ||
      kind == CollectiveKind::kReduceScatter) {
    const auto op = static_cast<ReduceKind>(w0 >> 16 & 0xff);
    text += ", " + std::string(reduceKindName(op));
    if (op == ReduceKind::kPremulSum) {
      double factor = 0;
      std::memcpy(&factor, &d.words[2], sizeof factor);
      char digits[32];
      std::snprintf(digits, sizeof digits, " by %.17g", factor);  // every bit that differs
      text += digits;
    }
  }
  if (kind == CollectiveKind::kReduce || kind == CollectiveKind::kBroadcast ||
      kind == CollectiveKind::kGather || kind == CollectiveKind::kScatter) {
    text += ", root " + std::to_string(root);
  }
  if (fused) {
    const std::string blocks = std::to_string((w0 >> kFusedBlocksShift & 63) + 1);
    text += ", fused into one kernel of " + blocks +
            (chain && kind == CollectiveKind::kAllReduce ? " blocks, around a ring"
             : chain                                     ? " blocks, along a chain"
             : twoShot                                   ? " blocks per role, in two shots"
                                                         : " block pairs");
  }
  return text;
}

std::string collectiveMismatch(int peer, int self, const cuda::Descriptor& theirs,
                               const cuda::Descriptor& mine) {
  const std::string calls = "on CUDA tensors, rank " + std::to_string(peer) + " issued " +
                            explain(theirs) + " where rank " + std::to_string(self) + " issued " +
                            explain(mine);
  // The settings that choose a kernel are agreed when the workspace is made, so calls that
  // differ in their kernel alone are one call on ranks that chose apart (their GPUs or MPS
  // states differ), not calls the user issued differently.
  const uint64_t kernel = kFusedBit | kTwoShotBit | kChainBit | uint64_t{63} << kFusedBlocksShift;
  const bool sameCall = ((theirs.words[0] ^ mine.words[0]) & ~kernel) == 0 &&
                        ((theirs.words[1] ^ mine.words[1]) & kCountMask) == 0 &&
                        theirs.words[2] == mine.words[2];
  if (sameCall) {
    return calls +
           ": the same call, for which the ranks chose different kernels, as ranks whose GPUs "
           "or MPS states differ may; LOOM_CUDA_FUSED=0 on every rank makes them all step";
  }
  return calls +
         "; every rank must issue the same collectives, with the same sizes, in the same order";
}

}  // namespace loom::detail
