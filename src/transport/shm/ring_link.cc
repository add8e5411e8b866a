// Message framing on shared-memory rings.

#include "transport/shm/ring_link.h"

#include <cstring>
#include <string>

#include "loom/error.h"

namespace loom::shm {

namespace {

constexpr uint32_t kHeaderMagic = 0x6d6f6f6c;  // "loom"

void encodeHeader(uint8_t* out, const Envelope& envelope) {
  const auto tag = static_cast<uint32_t>(envelope.tag);
  std::memcpy(out, &tag, 4);
  std::memcpy(out + 4, &kHeaderMagic, 4);
  std::memcpy(out + 8, &envelope.bytes, 8);
}

std::optional<Envelope> decodeHeader(const uint8_t* in) {
  uint32_t tag;
  uint32_t magic;
  Envelope envelope;
  std::memcpy(&tag, in, 4);
  std::memcpy(&magic, in + 4, 4);
  std::memcpy(&envelope.bytes, in + 8, 8);
  envelope.tag = static_cast<int>(tag);
  if (magic != kHeaderMagic || envelope.bytes > kMaxMessageBytes) return std::nullopt;
  return envelope;
}

}  // namespace

RingLink::RingLink(ShmComm& shm, int peer)
    : shm_(shm),
      peer_(peer),
      writer_(shm.ring(shm.rank(), peer), shm.ringData(shm.rank(), peer), shm.ringBytes()),
      reader_(shm.ring(peer, shm.rank()), shm.ringData(peer, shm.rank()), shm.ringBytes()) {}

bool RingLink::write(const Envelope& envelope, const uint8_t* payload, uint64_t& done) {
  if (done == 0) encodeHeader(outHeader_, envelope);
  const uint64_t total = kHeaderBytes + envelope.bytes;
  while (done < total) {
    size_t n;
    if (done < kHeaderBytes) {
      n = writer_.write(outHeader_ + done, kHeaderBytes - done);
    } else {
      const uint64_t at = done - kHeaderBytes;
      n = writer_.write(payload + at, envelope.bytes - at);
    }
    if (n == 0) return false;  // the ring is full
    done += n;
  }
  return true;
}

std::optional<Envelope> RingLink::nextEnvelope() {
  inHeaderBytes_ += reader_.read(inHeader_ + inHeaderBytes_, kHeaderBytes - inHeaderBytes_);
  if (inHeaderBytes_ < kHeaderBytes) return std::nullopt;
  inHeaderBytes_ = 0;
  const std::optional<Envelope> envelope = decodeHeader(inHeader_);
  if (!envelope) {
    throw Error(ErrorCode::kInternal, "recv", shm_.rank(),
                "corrupted point-to-point stream from rank " + std::to_string(peer_));
  }
  return envelope;
}

size_t RingLink::read(void* dst, size_t n) {
  return reader_.read(dst, n);
}

}  // namespace loom::shm
