#pragma once

#include <cstdint>
#include <memory>

#include "transport/shm/layout.h"
#include "util/comm_id.h"
#include "util/posix.h"

namespace loom::shm {

/// One communicator's shared memory: an anonymous memfd (it never appears in /dev/shm, so
/// nothing can leak when a process is killed), sealed against resizing, mapped once per
/// process. Ranks of one process that belong to the same communicator share the mapping.
class Segment {
 public:
  /// Creates, sizes, seals and maps a new segment and writes its header.
  static std::shared_ptr<Segment> create(const Layout& layout, const CommId& id);
  /// Maps a segment received from the leader after checking that it is one (magic,
  /// version, id, sizes: `size` ranks here of a communicator of `ranks`); throws
  /// Error(kSystem / kInternal) otherwise. Reuses this process's mapping of the same
  /// communicator if there is one.
  static std::shared_ptr<Segment> attach(posix::Fd fd, const CommId& id, int size, int ranks);
  /// This process's mapping of `id`, if another rank here already created or attached it.
  static std::shared_ptr<Segment> findMapped(const CommId& id);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  /// The memfd, to hand to members.
  int fd() const { return fd_.get(); }
  uint8_t* base() const { return base_; }
  const Layout& layout() const { return layout_; }
  SegmentHeader& header() const { return *reinterpret_cast<SegmentHeader*>(base_); }
  const CommId& id() const { return id_; }

 private:
  Segment(posix::Fd fd, uint8_t* base, const Layout& layout, const CommId& id);
  static uint8_t* map(int fd, const Layout& layout);
  posix::Fd fd_;
  uint8_t* base_;
  Layout layout_;
  CommId id_;
};

}  // namespace loom::shm
