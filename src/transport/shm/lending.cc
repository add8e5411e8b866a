// The lending pool (owner side) and the mappings of peers' lent regions (reader side).

#include "transport/shm/lending.h"

#include <pthread.h>

#include <algorithm>
#include <cstring>

#include "loom/error.h"

namespace loom::shm {

namespace {

// Regions come in whole 2 MiB steps (64 KiB below that), so a buffer freed and asked for again
// with a slightly different size (FSDP's padded groups) finds its region again.
size_t capacityFor(size_t bytes) {
  const size_t step = bytes < (size_t{2} << 20) ? size_t{64} << 10 : size_t{2} << 20;
  return std::max(step, (bytes + step - 1) / step * step);
}

std::atomic<uint64_t> lentCount{0};

}  // namespace

uint64_t lentCollectives() {
  return lentCount.load(std::memory_order_relaxed);
}

void countLentCollective() {
  lentCount.fetch_add(1, std::memory_order_relaxed);
}

LendingPool& LendingPool::instance() {
  // Never destroyed: tensors freed during interpreter shutdown still release into it.
  static auto* pool = new LendingPool();
  return *pool;
}

LendingPool::LendingPool() {
  ::pthread_atfork(&LendingPool::lockForFork, &LendingPool::unlockAfterFork,
                   &LendingPool::forgetInChild);
}

void LendingPool::lockForFork() {
  instance().mutex_.lock();
}

void LendingPool::unlockAfterFork() {
  instance().mutex_.unlock();
}

void LendingPool::forgetInChild() {
  LendingPool& pool = instance();
  for (auto& [address, entry] : pool.byAddress_) {
    (void)entry.region.release();  // left mapped: the child's inherited tensors point there
  }
  pool.byAddress_.clear();
  pool.available_.clear();
  pool.held_ = 0;
  pool.inUse_ = 0;
  pool.peakInUse_ = 0;
  pool.mutex_.unlock();
}

void* LendingPool::allocate(size_t bytes) {
  const size_t capacity = capacityFor(bytes);
  everLent_.store(true, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(mutex_);
  // The smallest region kept that fits, unless it would waste more than half of itself.
  auto fit = available_.lower_bound(capacity);
  if (fit != available_.end() && fit->first <= 2 * capacity) {
    const uintptr_t address = fit->second;
    noteInUse(fit->first);
    available_.erase(fit);
    byAddress_.at(address).inUse = true;
    return reinterpret_cast<void*>(address);
  }
  std::unique_ptr<Region> region;
  try {
    region = Region::create(capacity, "loom-lending-pool");
  } catch (const Error& e) {
    throw Error(ErrorCode::kSystem, "allocate_tensor", -1,
                "could not make " + std::to_string(capacity) +
                    " bytes of lendable shared memory: " + e.detail() + " (this process holds " +
                    std::to_string(byAddress_.size()) + " lendable regions, " +
                    std::to_string(held_) +
                    " bytes, each with a file descriptor: free lent tensors, allocate fewer and "
                    "larger buffers, or raise the limits, `ulimit -n` or /dev/shm's size)");
  }
  const auto address = reinterpret_cast<uintptr_t>(region->data());
  held_ += capacity;
  noteInUse(capacity);
  byAddress_.emplace(address, Entry{std::move(region), true});
  return reinterpret_cast<void*>(address);
}

void LendingPool::noteInUse(size_t capacity) {
  inUse_ += capacity;
  peakInUse_ = std::max(peakInUse_, inUse_);
}

void LendingPool::release(void* data) {
  const auto address = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = byAddress_.find(address);
  if (it == byAddress_.end() || !it->second.inUse) return;  // not ours, or released already
  it->second.inUse = false;
  inUse_ -= it->second.region->capacity();
  available_.emplace(it->second.region->capacity(), address);
  // Kept for reuse: as much as the process once had in use at once (kKeptFloor at least),
  // and kMaxKept regions (a descriptor each). Beyond that the smallest go first: a region
  // serves requests from half its size to its size, so a process whose requests grow would
  // otherwise keep every size it ever used. Freed here, a region is gone for good: a peer's
  // mapping keeps its pages until the peer drops it, which it does once it sees the region
  // marked closed (LentMappings), and a peer that opens the descriptor's number again finds
  // another region's id there and copies instead.
  const size_t keep = std::max(peakInUse_, kKeptFloor);
  while (!available_.empty() && (held_ - inUse_ > keep || available_.size() > kMaxKept)) {
    const auto smallest = available_.begin();
    held_ -= smallest->first;
    const auto entry = byAddress_.find(smallest->second);
    entry->second.region->markClosed();
    byAddress_.erase(entry);  // unmaps the region and closes its descriptor
    available_.erase(smallest);
  }
}

std::optional<LentBuffer> LendingPool::find(const void* data, size_t bytes) {
  const auto address = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = byAddress_.upper_bound(address);
  if (it == byAddress_.begin()) return std::nullopt;
  --it;
  const Entry& entry = it->second;
  const size_t offset = address - it->first;
  if (!entry.inUse || offset > entry.region->capacity() ||
      bytes > entry.region->capacity() - offset) {
    return std::nullopt;
  }
  LentBuffer lent{};
  lent.fd = entry.region->fd();
  std::memcpy(lent.id, entry.region->id().data(), sizeof lent.id);
  lent.capacity = entry.region->capacity();
  lent.offset = offset;
  lent.bytes = bytes;
  return lent;
}

size_t LendingPool::heldBytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return held_;
}

void LentMappings::dropClosed() {
  mappings_.remove_if([](const Mapping& m) { return m.region->closed(); });
}

const uint8_t* LentMappings::map(int pid, const LentBuffer& buffer) {
  Region::Id id;
  std::memcpy(id.data(), buffer.id, id.size());
  auto it = std::find_if(mappings_.begin(), mappings_.end(),
                         [&](const Mapping& m) { return m.pid == pid && m.id == id; });
  if (it == mappings_.end()) {
    std::unique_ptr<Region> region;
    try {
      region = Region::open(pid, buffer.fd, id, buffer.capacity);
    } catch (const Error&) {
      return nullptr;  // the caller falls back to copying through the slots
    }
    mappings_.push_front(Mapping{pid, id, std::move(region)});
    if (mappings_.size() > limit_) mappings_.pop_back();
    it = mappings_.begin();
  } else if (it != mappings_.begin()) {
    mappings_.splice(mappings_.begin(), mappings_, it);
  }
  const Region& region = *it->region;
  if (buffer.offset > region.capacity() || buffer.bytes > region.capacity() - buffer.offset) {
    return nullptr;
  }
  return region.data() + buffer.offset;
}

}  // namespace loom::shm
