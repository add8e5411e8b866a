// Creating, opening and sequence-locking tensor-store regions.

#include "transport/shm/region.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <new>

#include "loom/error.h"
#include "transport/shm/memfd.h"

namespace loom::shm {

namespace {

constexpr uint64_t kRegionMagic = 0x3152'5354'4d4f'4f4cULL;  // "LOOMTSR1", little-endian
constexpr const char* kOp = "tensor store";

uint8_t* mapRegion(int fd, size_t total, bool writable) {
  const int prot = writable ? PROT_READ | PROT_WRITE : PROT_READ;
  void* p = ::mmap(nullptr, total, prot, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) posix::throwErrno(kOp, "mapping a region");
    // Fault every page in now: regions are reused version after version, and a copy that
    // takes page faults runs at a fraction of memory bandwidth.
#if defined(MADV_POPULATE_WRITE) && defined(MADV_POPULATE_READ)
  // The owner's populate is also where a region larger than the host's memory fails, with
  // an error, rather than a SIGBUS or the OOM killer in the middle of a copy.
  if (::madvise(p, total, writable ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) != 0 &&
      errno == ENOMEM) {
    ::munmap(p, total);
    throw Error(ErrorCode::kSystem, kOp, -1,
                "not enough memory for a region of " + std::to_string(total) +
                    " bytes: put less, keep fewer versions, or free memory on this host");
  }
#endif
  return static_cast<uint8_t*>(p);
}

}  // namespace

Region::Region(posix::Fd fd, uint8_t* base, size_t capacity, bool writable)
    : fd_(std::move(fd)), base_(base), capacity_(capacity), writable_(writable) {}

Region::~Region() {
  ::munmap(base_, kHeaderBytes + capacity_);
}

std::unique_ptr<Region> Region::create(size_t capacity, const char* name) {
  const size_t total = kHeaderBytes + capacity;
  posix::Fd fd =
      sealedMemfd(name, total, kOp, "a region of " + std::to_string(capacity) + " bytes");
  uint8_t* base = mapRegion(fd.get(), total, /*writable=*/true);
  auto* header = new (base) RegionHeader{};
  header->magic = kRegionMagic;
  header->capacity = capacity;
  posix::randomBytes(header->id.data(), header->id.size());
  header->generation.store(0, std::memory_order_release);
  return std::unique_ptr<Region>(new Region(std::move(fd), base, capacity, true));
}

std::unique_ptr<Region> Region::open(int pid, int fd, const Id& id, size_t capacity) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  posix::Fd mine(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!mine) {
    const int err = errno;
    if (err == ENOENT) {
      throw Error(ErrorCode::kPeerFailure, kOp, -1,
                  "the owner (pid " + std::to_string(pid) +
                      ") has exited or released the region (" + path + " is gone)");
    }
    posix::throwErrno(kOp,
                      "opening " + path +
                          " (the owner must run as the same user, in "
                          "the same pid namespace)",
                      err);
  }
  struct stat st {};
  RegionHeader header{};
  const size_t headerBytes = offsetof(RegionHeader, generation);
  if (::fstat(mine.get(), &st) != 0 || static_cast<size_t>(st.st_size) != kHeaderBytes + capacity ||
      ::pread(mine.get(), &header, headerBytes, 0) != static_cast<ssize_t>(headerBytes) ||
      header.magic != kRegionMagic || header.capacity != capacity || header.id != id) {
    throw Error(ErrorCode::kMismatch, kOp, -1,
                "descriptor " + std::to_string(fd) + " of pid " + std::to_string(pid) +
                    " is no longer region " + regionIdHex(id) +
                    " (the owner released it: the version was replaced or deleted)");
  }
  if (!isSealed(mine.get())) {
    throw Error(ErrorCode::kMismatch, kOp, -1, "region is not sealed; refusing to map it");
  }
  uint8_t* base = mapRegion(mine.get(), kHeaderBytes + capacity, /*writable=*/false);
  // The mapping keeps the memory; a reader holds no descriptor (one per key would count
  // against its limit of open files).
  return std::unique_ptr<Region>(new Region(posix::Fd(), base, capacity, false));
}

void Region::beginWrite() {
  auto& g = header().generation;
  header().progress.store(0, std::memory_order_relaxed);
  // Release: a reader that sees the odd generation sees the progress reset with it.
  g.store(g.load(std::memory_order_relaxed) | 1, std::memory_order_release);
  // The odd generation must be visible before any byte of the new data.
  std::atomic_thread_fence(std::memory_order_release);
}

uint64_t Region::endWrite() {
  auto& g = header().generation;
  const uint64_t next = (g.load(std::memory_order_relaxed) | 1) + 1;
  g.store(next, std::memory_order_release);  // after every byte of the data
  return next;
}

void Region::setProgress(uint64_t bytes) {
  header().progress.store(bytes, std::memory_order_release);  // after those bytes
}

uint64_t Region::progress() const {
  return header().progress.load(std::memory_order_acquire);
}

uint64_t Region::abandonWrite() {
  auto& g = header().generation;
  // From the odd o of the write: o + 3, past the even o + 1 that write would have ended at.
  const uint64_t next = (g.load(std::memory_order_relaxed) | 1) + 3;
  g.store(next, std::memory_order_release);
  return next;
}

uint64_t Region::generation() const {
  return header().generation.load(std::memory_order_acquire);
}

bool Region::unchangedSince(uint64_t seen) const {
  // The copy's loads must complete before the generation is read again.
  std::atomic_thread_fence(std::memory_order_acquire);
  return (seen & 1) == 0 && header().generation.load(std::memory_order_relaxed) == seen;
}

void Region::markClosed() {
  header().closed.store(1, std::memory_order_release);
}

bool Region::closed() const {
  return header().closed.load(std::memory_order_acquire) != 0;
}

std::string regionIdHex(const Region::Id& id) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  for (uint8_t b : id) {
    out += kDigits[b >> 4];
    out += kDigits[b & 15];
  }
  return out;
}

Region::Id regionIdFromHex(const std::string& hex) {
  Region::Id id{};
  auto nibble = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw Error(ErrorCode::kInvalidArgument, kOp, -1, "region id '" + hex + "' is not hex");
  };
  if (hex.size() != 2 * id.size()) {
    throw Error(ErrorCode::kInvalidArgument, kOp, -1,
                "region id '" + hex + "' should have 32 hex digits");
  }
  for (size_t i = 0; i < id.size(); ++i) {
    id[i] = static_cast<uint8_t>(nibble(hex[2 * i]) << 4 | nibble(hex[2 * i + 1]));
  }
  return id;
}

}  // namespace loom::shm
