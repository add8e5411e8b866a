// The byte-fetch protocol's messages (the tensor store across hosts): what round-trips, and
// what a peer's bytes cannot make a server or reader accept.

#include <gtest/gtest.h>

#include <vector>

#include "transport/net/fetch_wire.h"

namespace loom::net {
namespace {

FetchRequest sampleRequest() {
  FetchRequest r;
  r.sequence = 42;
  r.source[0] = 9;
  r.source[15] = 1;
  r.generation = 6;
  r.ranges = {{0, 100}, {4096, 8192}, {1 << 20, 1}};
  return r;
}

TEST(FetchWire, MessagesRoundTrip) {
  const FetchIntroduction intro{"10.0.0.2:4242", 7};
  EXPECT_EQ(parseIntroduction(encodeIntroduction(intro)), intro);
  const FetchRequest request = sampleRequest();
  EXPECT_EQ(parseRequest(encodeRequest(request)), request);
  const FetchReply reply{42, SourceState::kWriting, 5, 1000};
  EXPECT_EQ(parseReply(encodeReply(reply)), reply);
  EXPECT_EQ(encodeReply(reply).size(), kReplyBytes);
  const FetchTrailer trailer{42, true};
  EXPECT_EQ(parseTrailer(encodeTrailer(trailer)), trailer);
  EXPECT_EQ(encodeTrailer(trailer).size(), kTrailerBytes);
}

TEST(FetchWire, RequestsWithBadRangesAreRefused) {
  const auto refused = [](std::vector<ByteRange> ranges) {
    FetchRequest r = sampleRequest();
    r.ranges = std::move(ranges);
    return !parseRequest(encodeRequest(r)).has_value();
  };
  EXPECT_TRUE(refused({}));                      // nothing asked
  EXPECT_TRUE(refused({{0, 0}}));                // an empty range
  EXPECT_TRUE(refused({{100, 10}, {0, 10}}));    // out of order
  EXPECT_TRUE(refused({{0, 100}, {50, 10}}));    // overlapping
  EXPECT_TRUE(refused({{UINT64_MAX - 1, 5}}));   // wrapping past the end
  EXPECT_FALSE(refused({{0, 100}, {100, 10}}));  // touching is fine
  std::vector<uint8_t> bytes = encodeRequest(sampleRequest());
  bytes.pop_back();  // a range cut short
  EXPECT_FALSE(parseRequest(bytes).has_value());
  bytes = encodeRequest(sampleRequest());
  bytes.push_back(0);  // trailing bytes
  EXPECT_FALSE(parseRequest(bytes).has_value());
}

TEST(FetchWire, OtherMessagesRefuseWhatIsNotThem) {
  std::vector<uint8_t> reply = encodeReply({1, SourceState::kWhole, 2, 0});
  reply[8] = 9;  // no such state
  EXPECT_FALSE(parseReply(reply).has_value());
  std::vector<uint8_t> trailer = encodeTrailer({1, true});
  trailer[8] = 2;  // neither yes nor no
  EXPECT_FALSE(parseTrailer(trailer).has_value());
  EXPECT_FALSE(parseIntroduction(encodeIntroduction({"", 1})).has_value());     // nowhere
  EXPECT_FALSE(parseIntroduction(encodeIntroduction({"a:1", 2})).has_value());  // a request channel
  EXPECT_FALSE(parseIntroduction(encodeIntroduction({std::string(300, 'a'), 1})).has_value());
  EXPECT_FALSE(parseIntroduction(encodeRequest(sampleRequest())).has_value());
}

TEST(FetchWire, RangesMerge) {
  const std::vector<ByteRange> merged =
      mergedRanges({{100, 10}, {0, 50}, {40, 20}, {60, 0}, {110, 5}, {200, 1}});
  const std::vector<ByteRange> expected{{0, 60}, {100, 15}, {200, 1}};
  EXPECT_EQ(merged, expected);
}

}  // namespace
}  // namespace loom::net
