#pragma once

// MessageLink over a pair of shared-memory byte rings (this rank to the peer and back).
// A message is a 16-byte header (tag, magic, length) and then its bytes, streamed as the
// ring frees up, so a large send completes once its last byte is in the ring.

#include <cstdint>
#include <optional>

#include "transport/message_link.h"
#include "transport/shm/byte_ring.h"
#include "transport/shm/shm_comm.h"

namespace loom::shm {

class RingLink final : public MessageLink {
 public:
  /// The link between `shm`'s rank and `peer` (the rank itself is allowed: a loopback).
  RingLink(ShmComm& shm, int peer);

  bool write(const Envelope& envelope, const uint8_t* payload, uint64_t& done) override;
  std::optional<Envelope> nextEnvelope() override;
  size_t read(void* dst, size_t n) override;
  bool readable() override { return reader_.available() > 0; }
  void notifyPeer() override { shm_.ringDoorbell(peer_); }

  /// Bytes of the header on the wire.
  static constexpr size_t kHeaderBytes = 16;

 private:
  ShmComm& shm_;
  const int peer_;
  RingWriter writer_;
  RingReader reader_;
  uint8_t outHeader_[kHeaderBytes] = {};  // the header of the message being written
  uint8_t inHeader_[kHeaderBytes] = {};   // the header being read
  size_t inHeaderBytes_ = 0;
};

}  // namespace loom::shm
