#pragma once

// Lending: buffers a rank's peers on its host read in place, so a large collective on them
// skips the copy into the shared slots (c10d's Backend::allocateTensor, which FSDP2 uses for
// its communication buffers, allocates from here).
//
// The owner side is one pool per process: regions (sealed memfds, see Region) carved into
// nothing smaller than the request, kept for reuse when their tensor is freed, like torch's
// caching allocators, up to what the process once had in use at once (release()); a region
// in use is never unmapped. The reader side keeps, per communicator, the peers' regions it
// mapped (read-only, through /proc/<pid>/fd, checked by the id in their header), so each is
// opened once.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "transport/shm/layout.h"
#include "transport/shm/region.h"

namespace loom::shm {

/// This process's lendable memory.
class LendingPool {
 public:
  /// The process's pool.
  static LendingPool& instance();

  /// At least `bytes` bytes (64-byte aligned, page-aligned in fact) of lendable memory.
  /// Throws Error(kSystem) if the host has not enough memory.
  void* allocate(size_t bytes);
  /// Bytes of free regions kept for reuse at least (more where the process once had more
  /// in use at once), and free regions kept at most.
  static constexpr size_t kKeptFloor = size_t{64} << 20;
  static constexpr size_t kMaxKept = 64;

  /// Returns memory from allocate() for reuse (from any thread); frees the smallest free
  /// regions beyond what is kept (kKeptFloor, kMaxKept).
  void release(void* data);
  /// Where [data, data + bytes) lies if it is inside one lendable allocation; nullopt if not
  /// (memory from anywhere else, or a range that runs past its allocation).
  std::optional<LentBuffer> find(const void* data, size_t bytes);
  /// Bytes held by the pool (in use and kept for reuse).
  size_t heldBytes();
  /// True once this process has allocated lendable memory (cheap: read on every collective).
  bool everLent() const { return everLent_.load(std::memory_order_relaxed); }

 private:
  LendingPool();
  struct Entry {
    std::unique_ptr<Region> region;
    bool inUse = false;
  };
  // Fork handlers (pthread_atfork): the pool's lock is held across fork, so a child never
  // inherits it locked by a thread it does not have; the child then forgets what the parent
  // made (still mapped there, shared with the parent, so never handed out again or lent as
  // the child's own).
  static void lockForFork();
  static void unlockAfterFork();
  static void forgetInChild();
  /// Counts `capacity` bytes more in use (mutex_ held).
  void noteInUse(size_t capacity);

  std::mutex mutex_;
  std::map<uintptr_t, Entry> byAddress_;        // every region, by its data address
  std::multimap<size_t, uintptr_t> available_;  // regions not in use, by capacity
  size_t held_ = 0;                             // bytes of every region (mutex_)
  size_t inUse_ = 0;                            // bytes of regions in use (mutex_)
  size_t peakInUse_ = 0;                        // the most inUse_ has been (mutex_)
  std::atomic<bool> everLent_{false};
};

/// Collectives this process ran that read lent inputs in place (tests and benchmarks check
/// with it that the path was taken), and the call that counts one.
uint64_t lentCollectives();
void countLentCollective();

/// One communicator's mappings of its peers' lent regions.
class LentMappings {
 public:
  /// Regions kept mapped at least; beyond the limit the least recently used is unmapped.
  static constexpr size_t kMaxMappings = 256;

  /// Keeps up to max(kMaxMappings, 2 x `ranks`) mappings: one call maps every peer's region,
  /// and none of those may go before the call is done with it (a host of more than 256
  /// ranks would otherwise unmap a call's first mappings while it maps its last).
  explicit LentMappings(int ranks = 0)
      : limit_(std::max(kMaxMappings, 2 * static_cast<size_t>(std::max(ranks, 0)))) {}

  /// The bytes `buffer` names in process `pid`, mapped read-only, or nullptr if they cannot
  /// be (another pid namespace, a region released, a map refused).
  const uint8_t* map(int pid, const LentBuffer& buffer);
  /// Unmaps the regions whose owners have let go of them (Region::closed), or a peer whose
  /// pool turns over would have the communicator keep every region it ever lent, up to the
  /// limit's count of them, however large. Never while a call reads through its mappings: a
  /// peer that left the call early may have freed its input by then, and the mapping is
  /// what keeps the pages the call still reads (it then fails, at its close).
  void dropClosed();

 private:
  struct Mapping {
    int pid;
    Region::Id id;
    std::unique_ptr<Region> region;
  };
  std::list<Mapping> mappings_;  // most recently used first
  size_t limit_;
};

}  // namespace loom::shm
