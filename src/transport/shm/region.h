#pragma once

// A region: one owner's bytes that peers on its host read in place, for the tensor store.
// An anonymous memfd (never a file in /dev/shm, so nothing outlives the processes that hold
// it), sealed against resizing, with a header page that carries a sequence lock: the owner
// makes the generation odd while it writes and even when the bytes are whole, and a reader
// keeps what it copied only if it saw the same even generation before and after. While it
// writes, the owner also publishes how far it got, so a reader can copy the front of a
// version while the back is still being written (and then checks the generation as usual).
//
// Peers open the owner's descriptor through /proc/<pid>/fd/<fd>, read-only: the kernel lets
// only the owner's user (and root) do that, the same trust docs/SECURITY.md gives any
// process of the user. The random id in the header, published with the descriptor number,
// tells a reader it opened this region and not a descriptor number reused since.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "util/posix.h"

namespace loom::shm {

/// The first page of a region.
struct RegionHeader {
  uint64_t magic;
  uint64_t capacity;                 ///< data bytes after the header page
  std::array<uint8_t, 16> id;        ///< random, published beside the descriptor number
  std::atomic<uint64_t> generation;  ///< odd while the owner writes, even when whole
  std::atomic<uint64_t> progress;    ///< bytes from the start already written this generation
  std::atomic<uint64_t> closed;      ///< 1 once the owner let go of the region (markClosed)
};

class Region {
 public:
  using Id = std::array<uint8_t, 16>;
  /// Bytes before the data: one page, so data is page-aligned for any dtype and for DMA.
  static constexpr size_t kHeaderBytes = 4096;

  /// Owner: a new region of `capacity` data bytes (0 is allowed: a header alone, for bytes
  /// that live elsewhere, such as device memory), mapped read-write, generation 0; `name` is
  /// what /proc/<pid>/maps shows for it.
  static std::unique_ptr<Region> create(size_t capacity, const char* name = "loom-tensor-store");
  /// Reader: opens region `id` of process `pid` (descriptor `fd`) read-only. Throws
  /// Error(kPeerFailure) if the process or descriptor is gone, kMismatch if it is not that
  /// region (the owner closed it and reused the number), kSystem if /proc refuses.
  static std::unique_ptr<Region> open(int pid, int fd, const Id& id, size_t capacity);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

  /// The descriptor peers open (owner side; -1 on a reader, which keeps only the mapping).
  int fd() const { return fd_.get(); }
  const Id& id() const { return header().id; }
  size_t capacity() const { return capacity_; }
  /// The data bytes (read-only memory on the reader side: never write through it there).
  uint8_t* data() const { return base_ + kHeaderBytes; }
  bool writable() const { return writable_; }

  /// Owner: marks the bytes as being rewritten (generation becomes odd).
  void beginWrite();
  /// Owner, while writing: the first `bytes` bytes hold the new data (readers may copy them).
  void setProgress(uint64_t bytes);
  /// Owner: marks the bytes whole again; returns the new (even) generation.
  uint64_t endWrite();
  /// Owner, after a write failed: the generation skips the even value that write would have
  /// ended at (published to readers of the version being written), so nobody takes its
  /// half-written bytes for that version; returns the new (even) generation.
  uint64_t abandonWrite();
  /// How many bytes from the start the write in progress has finished (acquire: reads of
  /// those bytes that follow see them).
  uint64_t progress() const;
  /// The generation now (acquire: reads of the data that follow see at least this write).
  uint64_t generation() const;
  /// Reader: true if no write began since the bytes were read at generation `seen` (an
  /// even number): call it after copying them out.
  bool unchangedSince(uint64_t seen) const;
  /// Owner, just before it lets go of the region for good: readers that keep mappings drop
  /// theirs when they see it (the pages live on as long as any mapping does).
  void markClosed();
  /// Reader: true once the owner has marked the region closed.
  bool closed() const;

 private:
  Region(posix::Fd fd, uint8_t* base, size_t capacity, bool writable);
  RegionHeader& header() const { return *reinterpret_cast<RegionHeader*>(base_); }

  posix::Fd fd_;
  uint8_t* base_;
  size_t capacity_;
  bool writable_;
};

/// The id as 32 hexadecimal digits, and back (throws Error(kInvalidArgument) on bad text).
std::string regionIdHex(const Region::Id& id);
Region::Id regionIdFromHex(const std::string& hex);

}  // namespace loom::shm
