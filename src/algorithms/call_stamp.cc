// Stamps on collectives' network messages (call_stamp.h).

#include "algorithms/call_stamp.h"

#include <cstring>

#include "util/word_hash.h"

namespace loom {

namespace {

constexpr int kSeqBits = 32;
constexpr int kKindShift = 32, kTypeShift = 36, kReduceShift = 40, kRestShift = 44;
constexpr uint64_t kNibble = 0xf;

uint64_t field(uint64_t stamp, int shift) {
  return (stamp >> shift) & kNibble;
}

// "all_reduce of float32 with sum", as far as the stamp tells.
std::string what(uint64_t stamp) {
  const auto kind = static_cast<CollectiveKind>(field(stamp, kKindShift));
  std::string s = std::string(collectiveName(kind)) + " of " +
                  std::string(dataTypeName(static_cast<DataType>(field(stamp, kTypeShift))));
  if (reduces(kind)) {
    s +=
        " with " + std::string(reduceKindName(static_cast<ReduceKind>(field(stamp, kReduceShift))));
  }
  return s;
}

}  // namespace

uint64_t callStamp(const CollectiveArgs& args, uint64_t seq) {
  uint64_t factorBits = 0;
  if (args.op.kind() == ReduceKind::kPremulSum) {
    const double factor = args.op.factor();
    std::memcpy(&factorBits, &factor, sizeof factorBits);
  }
  WordHash hash;
  hash.mix(args.count);
  hash.mix(static_cast<uint64_t>(static_cast<uint32_t>(args.root)));
  hash.mix(args.countsHash);
  hash.mix(factorBits);
  for (char c : args.signature) hash.mix(static_cast<uint8_t>(c));
  const uint64_t h = hash.value();
  // The kind is never 0 (CollectiveKind starts at 1), so neither is the stamp.
  return (seq & ((uint64_t{1} << kSeqBits) - 1)) |
         (static_cast<uint64_t>(args.kind) & kNibble) << kKindShift |
         (static_cast<uint64_t>(args.type) & kNibble) << kTypeShift |
         (static_cast<uint64_t>(args.op.kind()) & kNibble) << kReduceShift |
         (h >> kRestShift) << kRestShift;
}

std::string explainStamps(uint64_t theirs, uint64_t mine, uint64_t seq, const std::string& peer) {
  const auto mySeq = static_cast<uint32_t>(mine);
  const auto theirSeq = static_cast<uint32_t>(theirs);
  if (theirSeq != mySeq) {
    // Their call's number, as the one nearest this rank's with those low 32 bits.
    const auto delta = static_cast<int64_t>(static_cast<int32_t>(theirSeq - mySeq));
    const auto at = static_cast<uint64_t>(static_cast<int64_t>(seq) + delta);
    return peer + " sent a message of its collective #" + std::to_string(at) + " (" + what(theirs) +
           ") where this rank is in #" + std::to_string(seq) + " (" + what(mine) +
           "): the ranks issued different numbers of collectives, or an earlier one's "
           "arguments (a root, say) differed between hosts";
  }
  const std::string mineText = what(mine), theirText = what(theirs);
  if (mineText != theirText) {
    return peer + " issued " + theirText + " as collective #" + std::to_string(seq) +
           " where this rank issued " + mineText + ": the ranks issued different collectives";
  }
  return peer + " issued collective #" + std::to_string(seq) + " (" + mineText +
         ") with another count, root, per-rank counts, PREMUL_SUM factor or (desync debug) "
         "shapes than this rank: every rank must pass the same";
}

}  // namespace loom
