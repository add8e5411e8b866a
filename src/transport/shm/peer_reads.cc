// process_vm_readv around loom's use of it: the probe and whole-range reads.

#include "transport/shm/peer_reads.h"

#include <sys/uio.h>

#include <atomic>
#include <cerrno>
#include <random>

namespace loom::shm {

namespace {

std::atomic<uint64_t> peerReadCount{0};

}  // namespace

ReadProbe ownProbe() {
  // Never 0, so an unwritten probe never matches; static, so it outlives every communicator.
  static const uint64_t token = [] {
    std::random_device device;
    const uint64_t value = (uint64_t{device()} << 32) ^ device();
    return value == 0 ? uint64_t{1} : value;
  }();
  return {reinterpret_cast<uint64_t>(&token), token};
}

bool canReadFrom(int pid, const ReadProbe& probe) {
  if (pid <= 0 || probe.address == 0 || probe.token == 0) return false;
  uint64_t seen = 0;
  return readFrom(pid, &seen, reinterpret_cast<const void*>(probe.address), sizeof seen) == 0 &&
         seen == probe.token;
}

int readFrom(int pid, void* local, const void* remote, size_t bytes) {
  auto* to = static_cast<uint8_t*>(local);
  auto from = reinterpret_cast<uintptr_t>(remote);
  while (bytes > 0) {
    const iovec here{to, bytes};
    const iovec there{reinterpret_cast<void*>(from), bytes};
    const ssize_t n = ::process_vm_readv(pid, &here, 1, &there, 1, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EFAULT;  // nothing moved: the range is not readable
    to += n;
    from += static_cast<uintptr_t>(n);
    bytes -= static_cast<size_t>(n);
  }
  return 0;
}

uint64_t peerReadCollectives() {
  return peerReadCount.load(std::memory_order_relaxed);
}

void countPeerReadCollective() {
  peerReadCount.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace loom::shm
