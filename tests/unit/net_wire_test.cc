// The network wire format and connection proofs: what a remote stranger's bytes can and
// cannot make loom accept.

#include <gtest/gtest.h>

#include <vector>

#include "transport/net/auth.h"
#include "transport/net/wire.h"

namespace loom::net {
namespace {

Hello sampleHello(Role role) {
  Hello h;
  h.role = role;
  h.comm[0] = 7;
  h.sender = 3;
  h.receiver = 5;
  h.channel = 1;
  h.nonce = freshNonce();
  return h;
}

std::vector<uint8_t> frame(const FrameHeader& header, size_t payload) {
  std::vector<uint8_t> bytes(kFrameHeaderBytes + payload, 0xab);
  encodeFrameHeader(header, bytes.data());
  return bytes;
}

FrameHeader data(bool first, uint32_t length, uint64_t total = 0, int tag = 0, uint64_t stamp = 0) {
  FrameHeader h;
  h.type = FrameType::kData;
  h.first = first;
  h.length = length;
  if (first) h.envelope = {tag, total, stamp};
  return h;
}

TEST(NetWire, HelloAndProofRoundTrip) {
  const Hello hello = sampleHello(Role::kAcceptor);
  const auto bytes = encodeHello(hello);
  const auto parsed = parseHello(bytes);
  ASSERT_TRUE(parsed);
  EXPECT_EQ(*parsed, hello);
  ProofBytes proof{};
  proof[31] = 9;
  EXPECT_EQ(parseProof(encodeProof(proof)), proof);
}

TEST(NetWire, RejectsMalformedHellos) {
  auto bytes = encodeHello(sampleHello(Role::kInitiator));
  EXPECT_FALSE(parseHello(std::span(bytes).first(bytes.size() - 1)));  // short
  auto wrongMagic = bytes;
  wrongMagic[0] ^= 1;
  EXPECT_FALSE(parseHello(wrongMagic));
  auto wrongVersion = bytes;
  wrongVersion[8] ^= 1;  // the version before, or after
  EXPECT_FALSE(parseHello(wrongVersion));
  auto wrongRole = bytes;
  wrongRole[12] = 3;
  EXPECT_FALSE(parseHello(wrongRole));
  Hello self = sampleHello(Role::kInitiator);
  self.receiver = self.sender;  // a rank does not connect to itself
  EXPECT_FALSE(parseHello(encodeHello(self)));
  Hello negative = sampleHello(Role::kInitiator);
  negative.sender = -1;
  EXPECT_FALSE(parseHello(encodeHello(negative)));
  const auto proof = encodeProof(ProofBytes{});
  EXPECT_FALSE(parseHello(proof));
  EXPECT_FALSE(parseProof(bytes));
}

TEST(NetWire, FrameHeadersRoundTripAndMustMatchTheirFrame) {
  const auto first = frame(data(true, 100, 1000, -4, 0x8123'4567'89ab'cdefULL), 100);
  const auto h = parseFrameHeader(first);
  ASSERT_TRUE(h);
  EXPECT_TRUE(h->first);
  EXPECT_EQ(h->length, 100u);
  EXPECT_EQ(h->envelope.tag, -4);
  EXPECT_EQ(h->envelope.bytes, 1000u);
  EXPECT_EQ(h->envelope.stamp, 0x8123'4567'89ab'cdefULL);
  // Only a message's first frame carries an envelope; a later one with a stamp is malformed.
  auto later = frame(data(false, 100), 100);
  later[30] = 1;
  EXPECT_FALSE(parseFrameHeader(later));
  EXPECT_FALSE(parseFrameHeader(frame(data(true, 100, 1000), 99)));   // length != frame
  EXPECT_FALSE(parseFrameHeader(frame(data(true, 100, 1000), 101)));  // trailing bytes
  EXPECT_FALSE(parseFrameHeader(frame(data(true, 100, 50), 100)));    // more than the message
  // A message larger than any link carries is refused, not made room for (2^63 bytes killed
  // the receiving rank with an uncaught length_error).
  EXPECT_TRUE(parseFrameHeader(frame(data(true, 100, kMaxMessageBytes), 100)));
  EXPECT_FALSE(parseFrameHeader(frame(data(true, 100, kMaxMessageBytes + 1), 100)));
  EXPECT_FALSE(parseFrameHeader(frame(data(true, 100, uint64_t{1} << 63), 100)));
  EXPECT_FALSE(parseFrameHeader(std::span(first).first(kFrameHeaderBytes - 1)));
  auto reserved = first;
  reserved[2] = 1;
  EXPECT_FALSE(parseFrameHeader(reserved));
  auto flags = first;
  flags[1] = 0x80;
  EXPECT_FALSE(parseFrameHeader(flags));
  auto type = first;
  type[0] = 9;
  EXPECT_FALSE(parseFrameHeader(type));
}

TEST(NetWire, ControlFramesCarryNothingElse) {
  FrameHeader credit;
  credit.type = FrameType::kCredit;
  credit.credits = 4;
  const auto h = parseFrameHeader(frame(credit, 0));
  ASSERT_TRUE(h);
  EXPECT_EQ(h->credits, 4u);
  auto stamped = frame(credit, 0);
  stamped[30] = 1;
  EXPECT_FALSE(parseFrameHeader(stamped));           // no envelope, so no stamp
  EXPECT_FALSE(parseFrameHeader(frame(credit, 1)));  // no payload
  credit.credits = 0;
  EXPECT_FALSE(parseFrameHeader(frame(credit, 0)));  // an empty credit is noise
  FrameHeader goodbye;
  goodbye.type = FrameType::kGoodbye;
  ASSERT_TRUE(parseFrameHeader(frame(goodbye, 0)));
  EXPECT_FALSE(parseFrameHeader(frame(goodbye, 4)));  // no payload
  goodbye.credits = 1;
  EXPECT_FALSE(parseFrameHeader(frame(goodbye, 0)));  // no credits
  auto withCredits = frame(data(false, 8), 8);
  withCredits[4] = 1;  // data frames return no credits
  EXPECT_FALSE(parseFrameHeader(withCredits));
}

TEST(NetWire, MessageStreamAcceptsOnlyWholeMessages) {
  MessageStream s;
  EXPECT_TRUE(s.idle());
  EXPECT_TRUE(s.accept(data(false, 10)).has_value());  // a continuation of nothing
  EXPECT_FALSE(s.accept(data(true, 0, 0)));            // an empty message
  EXPECT_TRUE(s.idle());
  EXPECT_FALSE(s.accept(data(true, 10, 25)));
  EXPECT_EQ(s.remaining(), 15u);
  EXPECT_TRUE(s.accept(data(true, 5, 5)).has_value());  // a new message inside one
  EXPECT_TRUE(s.accept(data(false, 16)).has_value());   // more than announced
  EXPECT_TRUE(s.accept(data(false, 0)).has_value());    // an empty continuation
  EXPECT_FALSE(s.accept(data(false, 15)));
  EXPECT_TRUE(s.idle());
  FrameHeader credit;
  credit.type = FrameType::kCredit;
  credit.credits = 1;
  EXPECT_TRUE(s.accept(credit).has_value());
}

TEST(NetAuth, AProofHoldsOnlyForItsSecretRoleAndConnection) {
  const JobSecret secret{1, 2, 3};
  JobSecret other = secret;
  other[15] = 1;
  const Hello a = sampleHello(Role::kInitiator);
  const Hello b = sampleHello(Role::kAcceptor);
  const ProofBytes proof = makeProof(secret, Role::kInitiator, a, b);
  EXPECT_TRUE(checkProof(secret, Role::kInitiator, a, b, proof));
  EXPECT_FALSE(checkProof(other, Role::kInitiator, a, b, proof));  // another job's secret
  EXPECT_FALSE(checkProof(secret, Role::kAcceptor, a, b, proof));  // reflected back
  Hello replayed = b;
  replayed.nonce = freshNonce();  // a new connection
  EXPECT_FALSE(checkProof(secret, Role::kInitiator, a, replayed, proof));
  Hello redirected = a;
  redirected.receiver = 6;  // other traffic
  EXPECT_FALSE(checkProof(secret, Role::kInitiator, redirected, b, proof));
}

TEST(NetAuth, NoncesAreFresh) {
  EXPECT_NE(freshNonce(), freshNonce());
}

}  // namespace
}  // namespace loom::net
