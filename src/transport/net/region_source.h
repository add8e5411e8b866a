#pragma once

// Tensor-store regions (transport/shm/region.h) as ByteSources: RegionLockedSource reads
// the sequence lock of a region, whatever holds the bytes it guards; RegionSource sends the
// region's own bytes, in place.

#include <memory>

#include "transport/net/byte_server.h"
#include "transport/shm/region.h"

namespace loom::net {

/// A source whose generation, progress and second look are a region's sequence lock; the
/// bytes are the subclass's (the region's own, or device memory staged through the host).
class RegionLockedSource : public ByteSource {
 public:
  explicit RegionLockedSource(std::shared_ptr<shm::Region> region) : region_(std::move(region)) {}
  uint64_t generation() const override { return region_->generation(); }
  uint64_t progress() const override { return region_->progress(); }
  bool unchangedSince(uint64_t generation) const override {
    return region_->unchangedSince(generation);
  }

 protected:
  shm::Region& region() const { return *region_; }

 private:
  std::shared_ptr<shm::Region> region_;
};

/// The region's own bytes, sent in place.
class RegionSource final : public RegionLockedSource {
 public:
  using RegionLockedSource::RegionLockedSource;
  uint64_t capacity() const override { return region().capacity(); }
  std::span<const uint8_t> bytes(uint64_t offset, uint64_t length,
                                 std::unique_ptr<Staging>& /*staging*/) override {
    return {region().data() + offset, length};
  }
};

}  // namespace loom::net
