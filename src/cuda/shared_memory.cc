// Shareable device memory through the driver's virtual memory management API.

#include "cuda/shared_memory.h"

#include "cuda/driver.h"

namespace loom::cuda {

namespace {

CUmemAllocationProp propertiesFor(CUdevice device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

}  // namespace

std::unique_ptr<SharedMemory> SharedMemory::allocate(CUdevice device, size_t bytes) {
  const Driver& d = Driver::get();
  const CUmemAllocationProp prop = propertiesFor(device);
  size_t granularity = 0;
  check(d.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuda", -1, "cuMemGetAllocationGranularity");
  const size_t rounded = (bytes + granularity - 1) / granularity * granularity;
  CUmemGenericAllocationHandle handle = 0;
  check(d.cuMemCreate(&handle, rounded, &prop, 0), "cuda", -1,
        "cuMemCreate of " + std::to_string(rounded) + " bytes (is the GPU out of memory?)");
  std::unique_ptr<SharedMemory> memory(new SharedMemory(handle, rounded));
  memory->mapFor(device);
  check(d.cuMemsetD8(memory->address_, 0, rounded), "cuda", -1, "cuMemsetD8");
  // The memset returns before it has run (device memory), on the legacy default stream,
  // which torch's streams do not wait for: peers map and use the workspace as soon as it
  // is shared, and a late memset would wipe the flags they wrote. Waited for here, once.
  check(d.cuStreamSynchronize(nullptr), "cuda", -1, "cuStreamSynchronize after cuMemsetD8");
  return memory;
}

std::unique_ptr<SharedMemory> SharedMemory::open(int fd, size_t bytes, CUdevice accessor) {
  const Driver& d = Driver::get();
  CUmemGenericAllocationHandle handle = 0;
  // The driver takes the descriptor's value as the "handle" argument.
  check(
      d.cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
      "cuda", -1, "cuMemImportFromShareableHandle");
  std::unique_ptr<SharedMemory> memory(new SharedMemory(handle, bytes));
  memory->mapFor(accessor);
  return memory;
}

void SharedMemory::mapFor(CUdevice accessor) {
  // On failure the destructor releases what was made so far.
  const Driver& d = Driver::get();
  check(d.cuMemAddressReserve(&address_, bytes_, 0, 0, 0), "cuda", -1, "cuMemAddressReserve");
  check(d.cuMemMap(address_, bytes_, 0, handle_, 0), "cuda", -1, "cuMemMap");
  mapped_ = true;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = accessor;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(d.cuMemSetAccess(address_, bytes_, &access, 1), "cuda", -1,
        "cuMemSetAccess (can this GPU reach the peer's? peer-to-peer access may be off)");
}

SharedMemory::~SharedMemory() {
  const Driver& d = Driver::get();
  if (address_ != 0) {
    if (mapped_) d.cuMemUnmap(address_, bytes_);
    d.cuMemAddressFree(address_, bytes_);
    address_ = 0;
  }
  if (handle_ != 0) {
    d.cuMemRelease(handle_);
    handle_ = 0;
  }
}

posix::Fd SharedMemory::exportFd() const {
  int fd = -1;
  check(Driver::get().cuMemExportToShareableHandle(&fd, handle_,
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuda", -1, "cuMemExportToShareableHandle");
  return posix::Fd(fd);
}

}  // namespace loom::cuda
