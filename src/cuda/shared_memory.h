#pragma once

// Device memory that several processes map: allocated with cuMemCreate as a shareable
// allocation, exported as a POSIX file descriptor (handed to peers over a Unix socket with
// SCM_RIGHTS) and mapped by each of them at an address of their own. The mapping is
// readable and writable from one device (the mapping process's GPU).

#include <cuda.h>

#include <cstddef>
#include <memory>

#include "util/posix.h"

namespace loom::cuda {

class SharedMemory {
 public:
  /// At least `bytes` of new memory on `device` (rounded up to the allocation granularity),
  /// zeroed and mapped for `device`. The current context must be `device`'s.
  static std::unique_ptr<SharedMemory> allocate(CUdevice device, size_t bytes);
  /// Maps memory another process exported (`fd`, `bytes` as that process allocated) for
  /// access from `accessor`. Takes no ownership of `fd`.
  static std::unique_ptr<SharedMemory> open(int fd, size_t bytes, CUdevice accessor);
  ~SharedMemory();
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  /// A new descriptor for this memory, to hand to a peer.
  posix::Fd exportFd() const;
  CUdeviceptr address() const { return address_; }
  size_t bytes() const { return bytes_; }

 private:
  SharedMemory(CUmemGenericAllocationHandle handle, size_t bytes)
      : handle_(handle), bytes_(bytes) {}
  /// Reserves addresses, maps the allocation there and opens it to `accessor`.
  void mapFor(CUdevice accessor);

  CUmemGenericAllocationHandle handle_ = 0;
  CUdeviceptr address_ = 0;
  size_t bytes_ = 0;
  bool mapped_ = false;
};

}  // namespace loom::cuda
