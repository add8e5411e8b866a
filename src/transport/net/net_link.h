#pragma once

// MessageLink to a rank on another host: this rank's SendChannel to it, made on the first
// write, and the ReceiveChannel it connected to this rank, claimed once it has arrived and
// proved the secret. The fabric delivers on its own: there is no doorbell to ring, and the
// engine polls this link (polled()). The two directions share nothing, so one thread may
// write while another reads. Errors name the peer.

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "loom/error.h"
#include "transport/message_link.h"
#include "transport/net/channel.h"

namespace loom::net {

class NetLink final : public MessageLink {
 public:
  using Connect = std::function<std::unique_ptr<SendChannel>()>;
  using Claim = std::function<std::unique_ptr<ReceiveChannel>()>;

  /// Who drives the link: one thread, whose every readable() also moves queued sends along
  /// (the point-to-point engine, the control plane), or two, one per direction (collectives
  /// across hosts), where only write() and drained() touch the outbound side.
  enum class Drivers { kOne, kTwo };

  /// Whether the link's communicator has failed, so what it still holds for the peer will
  /// never matter (empty: never).
  using Failed = std::function<bool()>;

  /// `connect` makes the outbound channel; `claim` returns the inbound one, or nullptr while
  /// it has not arrived; `peer` names the peer in errors ("rank 3 (host 'b', 10.0.0.2:4242)").
  NetLink(Connect connect, Claim claim, std::string peer, Drivers drivers = Drivers::kOne,
          Failed failed = {})
      : connect_(std::move(connect)),
        claim_(std::move(claim)),
        peer_(std::move(peer)),
        drivers_(drivers),
        failed_(std::move(failed)) {}
  /// Closes the outbound channel without delivering what it holds if the communicator has
  /// failed: over a cut link its flush (SendChannel's destructor) would take 12 s per link.
  ~NetLink() override {
    if (out_ && failed_ && failed_()) out_->closeWithoutFlush();
  }
  NetLink(const NetLink&) = delete;
  NetLink& operator=(const NetLink&) = delete;
  /// A link over channels already made (tests).
  NetLink(std::unique_ptr<SendChannel> out, std::unique_ptr<ReceiveChannel> in)
      : out_(std::move(out)), in_(std::move(in)) {}

  bool write(const Envelope& envelope, const uint8_t* payload, uint64_t& done) override;
  bool writeBorrowed(const Envelope& envelope, const uint8_t* payload, uint64_t& done) override;
  bool writeBorrowedPrefix(const Envelope& envelope, const uint8_t* payload, uint64_t& done,
                           uint64_t ready) override;
  void abandonSends() noexcept override {
    if (out_) out_->abandon();
  }
  std::optional<Envelope> nextEnvelope() override;
  size_t read(void* dst, size_t n) override;
  std::span<const uint8_t> peek(size_t n) override;
  bool readable() override;
  void notifyPeer() override {}
  bool polled() const override { return true; }
  bool drained() override;
  bool peerLeft() const override { return outboundEnded() || inboundEnded(); }
  bool inboundEnded() const override { return in_ && in_->peerLeft(); }
  bool outboundEnded() const override { return out_ && out_->peerLeft(); }
  bool inboundMade() const override { return in_ != nullptr; }

 private:
  /// The inbound channel, claimed now if it has arrived.
  ReceiveChannel* inbound();
  [[noreturn]] void rethrow(const Error& e) const;
  bool writeAs(const Envelope& envelope, const uint8_t* payload, uint64_t& done, Payload mode,
               uint64_t produced = kWholePayload);
  /// The outbound channel, connected now if it is time: a channel the peer's process
  /// turned away (it did not know the communicator yet) is made again kReconnectAfter later,
  /// until the caller's own deadline gives up on the peer. nullptr meanwhile.
  SendChannel* outbound();
  /// Forgets a channel that threw TurnedAway.
  void turnedAway();

  static constexpr std::chrono::milliseconds kReconnectAfter{100};

  Connect connect_;
  Claim claim_;
  std::string peer_;
  Drivers drivers_ = Drivers::kOne;
  Failed failed_;
  std::unique_ptr<SendChannel> out_;
  std::unique_ptr<ReceiveChannel> in_;
  std::chrono::steady_clock::time_point reconnectAt_{};  // after a TurnedAway
};

}  // namespace loom::net
