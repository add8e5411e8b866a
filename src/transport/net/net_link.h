#pragma once

// MessageLink to a rank on another host: this rank's SendChannel to it and the
// ReceiveChannel it connected to this rank, both authenticated. The fabric delivers on its
// own, so there is no doorbell to ring.

#include <memory>

#include "transport/message_link.h"
#include "transport/net/channel.h"

namespace loom::net {

class NetLink final : public MessageLink {
 public:
  NetLink(std::unique_ptr<SendChannel> out, std::unique_ptr<ReceiveChannel> in)
      : out_(std::move(out)), in_(std::move(in)) {}

  bool write(const Envelope& envelope, const uint8_t* payload, uint64_t& done) override {
    return out_->write(envelope, payload, done);
  }
  std::optional<Envelope> nextEnvelope() override { return in_->nextEnvelope(); }
  size_t read(void* dst, size_t n) override { return in_->read(dst, n); }
  bool readable() override { return in_->readable(); }
  void notifyPeer() override {}

 private:
  std::unique_ptr<SendChannel> out_;
  std::unique_ptr<ReceiveChannel> in_;
};

}  // namespace loom::net
