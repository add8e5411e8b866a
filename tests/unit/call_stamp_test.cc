// The stamps on collectives' network messages: equal calls stamp alike, calls that must not
// meet stamp apart, and the explanation names what differs.

#include "algorithms/call_stamp.h"

#include <gtest/gtest.h>

#include <string>

namespace loom {
namespace {

CollectiveArgs call(CollectiveKind kind, DataType type, ReduceOp op, int root, size_t count) {
  return CollectiveArgs::of(kind, type, op, root, count, nullptr, nullptr);
}

const CollectiveArgs kSum = call(CollectiveKind::kAllReduce, DataType::kFloat32, ReduceOp(), 0, 64);

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(CallStamp, EqualCallsStampAlikeAndNoStampIsZero) {
  EXPECT_EQ(callStamp(kSum, 7), callStamp(kSum, 7));
  EXPECT_NE(callStamp(kSum, 7), 0u);
  EXPECT_NE(callStamp(call(CollectiveKind::kAllReduce, DataType::kFloat32, ReduceOp(), 0, 0), 0),
            0u);
  // The buffers are each rank's own: they take no part.
  CollectiveArgs elsewhere = kSum;
  float x = 0;
  elsewhere.input = &x;
  elsewhere.output = &x;
  EXPECT_EQ(callStamp(elsewhere, 7), callStamp(kSum, 7));
}

TEST(CallStamp, CallsThatMustNotMeetStampApart) {
  const uint64_t mine = callStamp(kSum, 7);
  EXPECT_NE(callStamp(kSum, 8), mine);
  EXPECT_NE(callStamp(call(CollectiveKind::kAllReduce, DataType::kFloat32,
                           ReduceOp(ReduceKind::kMax), 0, 64),
                      7),
            mine);
  EXPECT_NE(callStamp(call(CollectiveKind::kAllReduce, DataType::kInt32, ReduceOp(), 0, 64), 7),
            mine);
  EXPECT_NE(callStamp(call(CollectiveKind::kReduce, DataType::kFloat32, ReduceOp(), 0, 64), 7),
            mine);
  EXPECT_NE(callStamp(call(CollectiveKind::kAllReduce, DataType::kFloat32, ReduceOp(), 0, 65), 7),
            mine);
  const CollectiveArgs root0 =
      call(CollectiveKind::kBroadcast, DataType::kUInt8, ReduceOp(), 0, 64);
  const CollectiveArgs root1 =
      call(CollectiveKind::kBroadcast, DataType::kUInt8, ReduceOp(), 1, 64);
  EXPECT_NE(callStamp(root0, 7), callStamp(root1, 7));
  const auto premul = [](double f) {
    return call(CollectiveKind::kAllReduce, DataType::kFloat32, ReduceOp::premulSum(f), 0, 64);
  };
  EXPECT_NE(callStamp(premul(0.5), 7), callStamp(premul(0.25), 7));
  CollectiveArgs counted = kSum;
  counted.countsHash = 99;
  EXPECT_NE(callStamp(counted, 7), mine);
  CollectiveArgs signed_ = kSum;
  signed_.signature = "shapes [[4, 16]]";
  EXPECT_NE(callStamp(signed_, 7), mine);
}

TEST(CallStamp, TheExplanationNamesWhatDiffers) {
  const std::string peer = "rank 2 (host 'b')";
  const uint64_t mine = callStamp(kSum, 7);
  const std::string earlier = explainStamps(callStamp(kSum, 6), mine, 7, peer);
  EXPECT_TRUE(contains(earlier, "rank 2 (host 'b') sent a message of its collective #6"))
      << earlier;
  EXPECT_TRUE(contains(earlier, "where this rank is in #7")) << earlier;
  const auto max =
      call(CollectiveKind::kAllReduce, DataType::kFloat32, ReduceOp(ReduceKind::kMax), 0, 64);
  const std::string op = explainStamps(callStamp(max, 7), mine, 7, peer);
  EXPECT_TRUE(contains(op,
                       "issued all_reduce of float32 with MAX as collective #7 where this rank "
                       "issued all_reduce of float32 with SUM"))
      << op;
  const auto longer = call(CollectiveKind::kAllReduce, DataType::kFloat32, ReduceOp(), 0, 65);
  const std::string count = explainStamps(callStamp(longer, 7), mine, 7, peer);
  EXPECT_TRUE(contains(count, "with another count, root")) << count;
  // Sequence numbers past 2^32 are told apart by their low bits and named in full.
  const uint64_t far = (uint64_t{1} << 32) + 5;
  const std::string wrapped =
      explainStamps(callStamp(kSum, far - 1), callStamp(kSum, far), far, peer);
  EXPECT_TRUE(contains(wrapped, std::string("#").append(std::to_string(far - 1)).append(" (")))
      << wrapped;
}

}  // namespace
}  // namespace loom
