// What a CUDA call's descriptor says (core/cuda_descriptors.h), checked on the host: a
// collective's step tag, which tells a peer's descriptor left from an earlier step (its
// kernels stopped) from a mismatch, and the words the mismatch error reads.

#include "core/cuda_descriptors.h"
#include "transport/shm/layout.h"

#include <gtest/gtest.h>

#include <string>

namespace loom::detail {
namespace {

CollectiveArgs allReduceOf(size_t count) {
  return CollectiveArgs::of(CollectiveKind::kAllReduce, DataType::kFloat32, ReduceOp{}, 0, count,
                            nullptr, nullptr);
}

TEST(CudaDescriptors, ADescriptorLeftFromAnotherStepIsStaleNotAMismatch) {
  const cuda::Descriptor call = describe(allReduceOf(1000));
  const cuda::Descriptor now = stepTagged(call, 7);
  EXPECT_TRUE(staleStep(now, stepTagged(call, 5)));  // the same call two steps before
  EXPECT_FALSE(staleStep(now, now));
  // Left from another step, any call is stale: another count, another kind, or a fused call.
  CollectiveArgs broadcast = allReduceOf(1000);
  broadcast.kind = CollectiveKind::kBroadcast;
  EXPECT_TRUE(staleStep(now, stepTagged(describe(allReduceOf(2000)), 5)));
  EXPECT_TRUE(staleStep(now, stepTagged(describe(broadcast), 5)));
  cuda::Descriptor fused = describe(allReduceOf(1000));
  fused.words[0] |= kFusedBit;
  EXPECT_TRUE(staleStep(now, stepTagged(fused, 5)));
  // A fused call at the same step where this rank steps is a mismatch (sizes that chose
  // different paths).
  EXPECT_FALSE(staleStep(now, stepTagged(fused, 7)));
  // At the same step, another count or kind is the caller's mismatch.
  EXPECT_FALSE(staleStep(now, stepTagged(describe(allReduceOf(2000)), 7)));
  EXPECT_FALSE(staleStep(now, stepTagged(describe(broadcast), 7)));
  // Steps wrap in 16 bits: 65536 steps apart look alike, as they may.
  EXPECT_EQ(stepTagged(call, 7).words[1], stepTagged(call, 7 + 65536).words[1]);
}

TEST(CudaDescriptors, AReplayTellsItsStepsFromAnEarlierReplays) {
  // A captured call's third step, tagged by the host from the call's start; replays of its
  // graph (one call of 8 steps) start it at device epochs 0, 8, 16, ...
  const cuda::Descriptor call = describe(allReduceOf(1000));
  const cuda::Descriptor captured = stepTagged(call, 3);
  const cuda::Descriptor now = cuda::replayTagged(captured, 16);
  EXPECT_TRUE(staleStep(now, cuda::replayTagged(captured, 8)));  // left by the replay before
  EXPECT_FALSE(staleStep(now, cuda::replayTagged(captured, 16)));
  EXPECT_EQ(now.words[1], stepTagged(call, 19).words[1]);  // the step's device epoch
  EXPECT_EQ(now.words[0], call.words[0]);
  EXPECT_EQ(now.words[2], call.words[2]);
  EXPECT_EQ(now.words[1] & kCountMask, 1000u);
  // Past 2^16 the tag wraps as an eager step's does, the count untouched.
  EXPECT_EQ(cuda::replayTagged(captured, 65535).words[1], stepTagged(call, 3 + 65535).words[1]);
  EXPECT_EQ(cuda::replayTagged(captured, (uint64_t{1} << 40) + 5).words[1] & kCountMask, 1000u);
}

TEST(CudaDescriptors, AChunkLeftInItsSlotByAnIdenticalMessageIsStale) {
  // The pair's chunk number 5 is this message's chunk 2; number 3 went through the same
  // mailbox slot, chunk 2 of an identical earlier message, and a sender whose kernels stopped
  // leaves it there while its flag still goes up.
  const Transfer t{Transfer::Kind::kSend, 1, 3, nullptr, 1 << 20};
  const cuda::Descriptor now = describeChunk(t, kSendRecv, 2, 5);
  EXPECT_NE(now.words[2], describeChunk(t, kSendRecv, 2, 3).words[2]);
  EXPECT_TRUE(staleStep(now, describeChunk(t, kSendRecv, 2, 3)));
  EXPECT_FALSE(staleStep(now, now));
  // At the same number, another chunk, tag or size is the caller's mismatch.
  EXPECT_FALSE(staleStep(now, describeChunk(t, kSendRecv, 0, 5)));
  Transfer other = t;
  other.tag = 4;
  EXPECT_FALSE(staleStep(now, describeChunk(other, kSendRecv, 2, 5)));
  EXPECT_FALSE(staleStep(describeChunk(t, kAllToAllBlock, 0, 7),
                         describeChunk(other, kAllToAllBlock, 0, 7)));
}

TEST(CudaDescriptors, AReplayNumbersItsChunksOnFromThePairsCounts) {
  // Rank 2's counts [peer][sent, taken] before a replay; the host numbered the captured
  // call's chunks from its start. Sent to peer 1 as the pair's first chunk of the call, the
  // chunk reads as number 41 + 1, as an eager call's would, and rank 1 expects it taken from
  // peer 2 (its taken count, 41) at the same number.
  const uint64_t senderCounts[] = {0, 0, 41, 9};
  const uint64_t receiverCounts[] = {0, 0, 0, 0, 7, 41};
  const Transfer t{Transfer::Kind::kSend, 1, 3, nullptr, 4096};
  const cuda::Descriptor captured = describeChunk(t, kSendRecv, 0, 1);
  const cuda::Descriptor sent = cuda::sequenced(captured, senderCounts, 1, false);
  const cuda::Descriptor expected = cuda::sequenced(captured, receiverCounts, 2, true);
  EXPECT_EQ(sent.words[2], describeChunk(t, kSendRecv, 0, 42).words[2]);
  EXPECT_FALSE(staleStep(expected, sent));
  // The replay before left the same message as number 40: stale.
  EXPECT_TRUE(staleStep(expected, describeChunk(t, kSendRecv, 0, 40)));
  // Eager calls number their chunks whole.
  EXPECT_EQ(cuda::sequenced(captured, nullptr, 1, false).words[2], 1u);
}

TEST(CudaDescriptors, TheErrorReadsTheCountWithoutTheStep) {
  const std::string words = explain(stepTagged(describe(allReduceOf(1000)), 12345));
  EXPECT_NE(words.find("all_reduce of float32, 1000 elements"), std::string::npos) << words;
  CollectiveArgs uneven = allReduceOf(0);
  uneven.kind = CollectiveKind::kAllGather;
  uneven.variable = true;
  uneven.countsHash = 0xfedcba9876543210ull;
  const std::string hashed = explain(stepTagged(describe(uneven), 3));
  EXPECT_NE(hashed.find("per-rank sizes with hash ba9876543210"), std::string::npos) << hashed;
  // A message of a transfer keeps its bytes and chunk.
  const Transfer t{Transfer::Kind::kSend, 1, 3, nullptr, 4096};
  const std::string message = explain(describeChunk(t, kSendRecv, 2, 9));
  EXPECT_NE(message.find("a message with tag 3 of 4096 bytes (chunk 2)"), std::string::npos)
      << message;
}

TEST(CudaDescriptors, APremulSumsFactorIsInItsDescriptor) {
  // Ranks that scale by different factors would get sums that differ by rank: their
  // descriptors differ, and the error says both factors.
  CollectiveArgs half = allReduceOf(1000);
  half.op = ReduceOp::premulSum(0.5);
  CollectiveArgs quarter = half;
  quarter.op = ReduceOp::premulSum(0.25);
  const cuda::Descriptor a = describe(half);
  const cuda::Descriptor b = describe(quarter);
  EXPECT_NE(a.words[2], b.words[2]);
  EXPECT_EQ(a.words[0], b.words[0]);
  EXPECT_EQ(a.words[1], b.words[1]);
  const std::string message = collectiveMismatch(1, 0, stepTagged(b, 4), stepTagged(a, 4));
  EXPECT_NE(message.find("PREMUL_SUM by 0.25 where rank 0"), std::string::npos) << message;
  EXPECT_NE(message.find("PREMUL_SUM by 0.5;"), std::string::npos) << message;
  EXPECT_NE(message.find("every rank must issue the same collectives"), std::string::npos)
      << message;
  // A factor in device memory is the kernels' to write: the host leaves the word 0.
  const double onDevice = 0.5;
  half.op = ReduceOp::premulSumOnDevice(&onDevice);
  EXPECT_EQ(describe(half).words[2], 0u);
  // Other reductions carry no factor.
  EXPECT_EQ(describe(allReduceOf(1000)).words[2], 0u);
}

TEST(CudaDescriptors, AMismatchOfFusedCallsKeepsItsAdviceWithinTheFailureRecord) {
  // The longest words two calls can have: fused broadcasts of a count of 14 digits from a
  // high root, in two shots of 64 blocks and along a chain. Every descriptor once named seven
  // settings, and the failure record (496 bytes) cut the advice off.
  CollectiveArgs broadcast = allReduceOf((uint64_t{1} << 47) - 1);
  broadcast.kind = CollectiveKind::kBroadcast;
  broadcast.type = DataType::kBFloat16;
  broadcast.root = 1 << 20;
  cuda::Descriptor twoShot = describe(broadcast);
  twoShot.words[0] |= kFusedBit | kTwoShotBit | uint64_t{63} << kFusedBlocksShift;
  cuda::Descriptor chain = describe(broadcast);
  chain.words[0] |= kFusedBit | kChainBit | uint64_t{62} << kFusedBlocksShift;
  // Other calls: the user's to fix.
  cuda::Descriptor otherRoot = chain;
  otherRoot.words[0] ^= uint64_t{1} << 32;
  const std::string issued =
      collectiveMismatch(1 << 20, (1 << 20) - 1, stepTagged(twoShot, 65535), otherRoot);
  EXPECT_NE(issued.find("every rank must issue the same collectives"), std::string::npos) << issued;
  EXPECT_EQ(issued.find("LOOM_CUDA_FUSED"), std::string::npos) << issued;
  EXPECT_LT(issued.size(), sizeof(shm::FailureRecord::message))
      << issued;  // the reader adds its prefix
  // One call run with different kernels (settings are agreed at set-up; GPUs may differ):
  // not the user's calls.
  const std::string kernels =
      collectiveMismatch(1 << 20, (1 << 20) - 1, stepTagged(twoShot, 65535), chain);
  EXPECT_NE(kernels.find("the same call, for which the ranks chose different kernels"),
            std::string::npos)
      << kernels;
  EXPECT_EQ(kernels.find("every rank must issue"), std::string::npos) << kernels;
  EXPECT_LT(kernels.size(), sizeof(shm::FailureRecord::message)) << kernels;
  // Sizes that chose different kernels are different calls.
  CollectiveArgs smaller = broadcast;
  smaller.count = 1000;
  const std::string sizes = collectiveMismatch(1, 0, describe(smaller), chain);
  EXPECT_NE(sizes.find("every rank must issue"), std::string::npos) << sizes;
}

}  // namespace
}  // namespace loom::detail
