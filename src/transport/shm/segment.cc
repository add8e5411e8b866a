// Creating, checking and mapping memfd segments.

#include "transport/shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <mutex>
#include <new>

#include "loom/error.h"
#include "transport/shm/memfd.h"

namespace loom::shm {

namespace {

// Mappings alive in this process, by communicator id.
std::mutex gRegistryMutex;
std::map<CommId, std::weak_ptr<Segment>>& registry() {
  static auto* r = new std::map<CommId, std::weak_ptr<Segment>>();
  return *r;
}

}  // namespace

Segment::Segment(posix::Fd fd, uint8_t* base, const Layout& layout, const CommId& id)
    : fd_(std::move(fd)), base_(base), layout_(layout), id_(id) {}

Segment::~Segment() {
  ::munmap(base_, layout_.total);
  std::lock_guard<std::mutex> lock(gRegistryMutex);
  auto it = registry().find(id_);
  if (it != registry().end() && it->second.expired()) registry().erase(it);
}

uint8_t* Segment::map(int fd, const Layout& layout) {
  void* p = ::mmap(nullptr, layout.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) posix::throwErrno("create", "mapping the shared segment");
    // Fault in the control area and the slots now, so the first collective does not pay for
    // it; the rings stay untouched until point-to-point traffic uses them.
#ifdef MADV_POPULATE_WRITE
  ::madvise(p, layout.rings, MADV_POPULATE_WRITE);
#endif
  return static_cast<uint8_t*>(p);
}

std::shared_ptr<Segment> Segment::create(const Layout& layout, const CommId& id) {
  posix::Fd fd = sealedMemfd("loom", layout.total, "create", "the shared segment");
  uint8_t* base = map(fd.get(), layout);
  auto* header = new (base) SegmentHeader{};
  header->magic = kMagic;
  header->version = kLayoutVersion;
  header->size = layout.size;
  header->ranks = layout.ranks;
  header->chunkBytes = layout.chunkBytes;
  header->ringBytes = layout.ringBytes;
  header->totalBytes = layout.total;
  std::memcpy(header->commId, id.data(), id.size());
  std::shared_ptr<Segment> segment(new Segment(std::move(fd), base, layout, id));
  std::lock_guard<std::mutex> lock(gRegistryMutex);
  registry()[id] = segment;
  return segment;
}

std::shared_ptr<Segment> Segment::findMapped(const CommId& id) {
  std::lock_guard<std::mutex> lock(gRegistryMutex);
  auto it = registry().find(id);
  return it == registry().end() ? nullptr : it->second.lock();
}

std::shared_ptr<Segment> Segment::attach(posix::Fd fd, const CommId& id, int size, int ranks) {
  if (auto mapped = findMapped(id)) return mapped;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) posix::throwErrno("create", "fstat of the shared segment");
  SegmentHeader header;
  if (static_cast<size_t>(st.st_size) < sizeof header ||
      ::pread(fd.get(), &header, sizeof header, 0) != static_cast<ssize_t>(sizeof header)) {
    throw Error(ErrorCode::kInternal, "create", -1, "the segment received is too small");
  }
  if (header.magic != kMagic || header.version != kLayoutVersion || header.size != size ||
      header.ranks != ranks || std::memcmp(header.commId, id.data(), id.size()) != 0 ||
      header.totalBytes != static_cast<uint64_t>(st.st_size)) {
    throw Error(ErrorCode::kInternal, "create", -1,
                "the segment received does not belong to this communicator (or comes from a "
                "different loom version)");
  }
  // A segment whose size could change under our mapping would let any holder SIGBUS us.
  if (!isSealed(fd.get())) {
    throw Error(ErrorCode::kInternal, "create", -1,
                "the segment received is not sealed against resizing; refusing to map it");
  }
  const Layout layout = Layout::compute(size, ranks, header.chunkBytes, header.ringBytes);
  if (layout.total != header.totalBytes) {
    throw Error(ErrorCode::kInternal, "create", -1, "the segment received has a foreign layout");
  }
  uint8_t* base = map(fd.get(), layout);
  std::shared_ptr<Segment> segment(new Segment(std::move(fd), base, layout, id));
  std::lock_guard<std::mutex> lock(gRegistryMutex);
  auto& slot = registry()[id];
  if (auto existing = slot.lock()) return existing;  // another thread attached meanwhile
  slot = segment;
  return segment;
}

}  // namespace loom::shm
