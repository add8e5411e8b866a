// Encoding and bounds-checked decoding of the network wire format.

#include "transport/net/wire.h"

#include <cstring>

#include "util/bytes.h"

namespace loom::net {

namespace {

constexpr uint8_t kFlagFirst = 1;

template <size_t N>
std::array<uint8_t, N> toArray(const std::vector<uint8_t>& bytes) {
  std::array<uint8_t, N> out{};
  std::memcpy(out.data(), bytes.data(), N);
  return out;
}

}  // namespace

std::array<uint8_t, kHelloBytes> encodeHello(const Hello& hello) {
  ByteWriter w;
  w.integer(kHelloMagic);
  w.integer(kWireVersion);
  w.integer(static_cast<uint32_t>(hello.role));
  w.raw(hello.comm.data(), hello.comm.size());
  w.integer(hello.sender);
  w.integer(hello.receiver);
  w.integer(hello.channel);
  w.raw(hello.nonce.data(), hello.nonce.size());
  return toArray<kHelloBytes>(w.bytes());
}

std::array<uint8_t, kVersionNoteBytes> encodeVersionNote() {
  ByteWriter w;
  w.integer(kHelloMagic);
  w.integer(kWireVersion);
  return toArray<kVersionNoteBytes>(w.bytes());
}

std::optional<uint32_t> declaredVersion(std::span<const uint8_t> bytes) {
  ByteReader in(bytes);
  uint64_t magic = 0;
  uint32_t version = 0;
  if (!in.integer(&magic) || magic != kHelloMagic || !in.integer(&version)) return std::nullopt;
  return version;
}

std::optional<Hello> parseHello(std::span<const uint8_t> bytes) {
  if (bytes.size() != kHelloBytes) return std::nullopt;
  ByteReader in(bytes);
  uint64_t magic = 0;
  uint32_t version = 0;
  uint32_t role = 0;
  Hello hello;
  if (!in.integer(&magic) || magic != kHelloMagic || !in.integer(&version) ||
      version != kWireVersion || !in.integer(&role) ||
      (role != static_cast<uint32_t>(Role::kInitiator) &&
       role != static_cast<uint32_t>(Role::kAcceptor)) ||
      !in.raw(hello.comm.data(), hello.comm.size()) || !in.integer(&hello.sender) ||
      !in.integer(&hello.receiver) || !in.integer(&hello.channel) ||
      !in.raw(hello.nonce.data(), hello.nonce.size())) {
    return std::nullopt;
  }
  if (hello.sender < 0 || hello.receiver < 0 || hello.sender == hello.receiver) return std::nullopt;
  hello.role = static_cast<Role>(role);
  return hello;
}

std::array<uint8_t, kProofBytes> encodeProof(const ProofBytes& proof) {
  ByteWriter w;
  w.integer(kProofMagic);
  w.raw(proof.data(), proof.size());
  return toArray<kProofBytes>(w.bytes());
}

std::optional<ProofBytes> parseProof(std::span<const uint8_t> bytes) {
  if (bytes.size() != kProofBytes) return std::nullopt;
  ByteReader in(bytes);
  uint64_t magic = 0;
  ProofBytes proof{};
  if (!in.integer(&magic) || magic != kProofMagic || !in.raw(proof.data(), proof.size())) {
    return std::nullopt;
  }
  return proof;
}

void encodeFrameHeader(const FrameHeader& header, uint8_t* out) {
  ByteWriter w;
  w.integer(static_cast<uint8_t>(header.type));
  w.integer(static_cast<uint8_t>(header.first ? kFlagFirst : 0));
  w.integer(uint16_t{0});
  w.integer(header.credits);
  w.integer(header.length);
  w.integer(header.first ? header.envelope.tag : 0);
  w.integer(header.first ? header.envelope.bytes : uint64_t{0});
  w.integer(header.first ? header.envelope.stamp : uint64_t{0});
  std::memcpy(out, w.bytes().data(), kFrameHeaderBytes);
}

std::optional<FrameHeader> parseFrameHeader(std::span<const uint8_t> bytes) {
  ByteReader in(bytes);
  uint8_t type = 0, flags = 0;
  uint16_t reserved16 = 0;
  FrameHeader h;
  if (!in.integer(&type) || !in.integer(&flags) || !in.integer(&reserved16) ||
      !in.integer(&h.credits) || !in.integer(&h.length) || !in.integer(&h.envelope.tag) ||
      !in.integer(&h.envelope.bytes) || !in.integer(&h.envelope.stamp)) {
    return std::nullopt;
  }
  if (reserved16 != 0 || (flags & ~kFlagFirst) != 0) return std::nullopt;
  h.first = (flags & kFlagFirst) != 0;
  if (type == static_cast<uint8_t>(FrameType::kData)) {
    h.type = FrameType::kData;
    if (h.credits != 0 || h.length != in.remaining()) return std::nullopt;
    if (!h.first && (h.envelope.tag != 0 || h.envelope.bytes != 0 || h.envelope.stamp != 0)) {
      return std::nullopt;
    }
    if (h.first && (h.length > h.envelope.bytes || h.envelope.bytes > kMaxMessageBytes)) {
      return std::nullopt;
    }
    return h;
  }
  if (type == static_cast<uint8_t>(FrameType::kGoodbye)) {
    h.type = FrameType::kGoodbye;
    if (h.first || h.length != 0 || h.credits != 0 || h.envelope.tag != 0 ||
        h.envelope.bytes != 0 || h.envelope.stamp != 0 || !in.atEnd()) {
      return std::nullopt;
    }
    return h;
  }
  if (type == static_cast<uint8_t>(FrameType::kCredit)) {
    h.type = FrameType::kCredit;
    if (h.first || h.length != 0 || h.credits == 0 || h.envelope.tag != 0 ||
        h.envelope.bytes != 0 || h.envelope.stamp != 0 || !in.atEnd()) {
      return std::nullopt;
    }
    return h;
  }
  return std::nullopt;
}

std::optional<std::string> MessageStream::accept(const FrameHeader& header) {
  if (header.type != FrameType::kData)
    return std::string("a control frame inside the message stream");
  if (header.first) {
    if (inMessage_) {
      return "a new message began with " + std::to_string(remaining_) +
             " bytes of the last one missing";
    }
    remaining_ = header.envelope.bytes - header.length;
    inMessage_ = remaining_ > 0;
    return std::nullopt;
  }
  if (!inMessage_) return std::string("a continuation frame outside any message");
  if (header.length == 0 || header.length > remaining_) {
    return "a continuation of " + std::to_string(header.length) + " bytes where " +
           std::to_string(remaining_) + " were left";
  }
  remaining_ -= header.length;
  inMessage_ = remaining_ > 0;
  return std::nullopt;
}

}  // namespace loom::net
