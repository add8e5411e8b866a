#pragma once

// A tensor-store region (transport/shm/region.h) as a ByteSource: its bytes are sent in
// place, under its own sequence lock.

#include <memory>

#include "transport/net/byte_server.h"
#include "transport/shm/region.h"

namespace loom::net {

class RegionSource final : public ByteSource {
 public:
  explicit RegionSource(std::shared_ptr<shm::Region> region) : region_(std::move(region)) {}
  uint64_t capacity() const override { return region_->capacity(); }
  uint64_t generation() const override { return region_->generation(); }
  uint64_t progress() const override { return region_->progress(); }
  bool unchangedSince(uint64_t generation) const override {
    return region_->unchangedSince(generation);
  }
  std::span<const uint8_t> bytes(uint64_t offset, uint64_t length,
                                 std::unique_ptr<Staging>& /*staging*/) override {
    return {region_->data() + offset, length};
  }

 private:
  std::shared_ptr<shm::Region> region_;
};

}  // namespace loom::net
