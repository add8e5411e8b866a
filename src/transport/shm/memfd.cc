// Creating and checking sealed memfds.

#include "transport/shm/memfd.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::shm {

namespace {

// Fixed size, and the seals themselves fixed.
constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

}  // namespace

posix::Fd sealedMemfd(const char* name, size_t bytes, std::string_view op,
                      const std::string& what) {
  posix::Fd fd(::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) posix::throwErrno(op, "memfd_create");
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0)
    posix::throwErrno(op, "sizing " + what);
  // memfds are created 0777: defence in depth, so that even a path to the fd
  // (/proc/<pid>/fd/<n>) that another user could traverse would not open it.
  if (::fchmod(fd.get(), 0600) != 0) posix::throwErrno(op, "fchmod of " + what);
  if (::fcntl(fd.get(), F_ADD_SEALS, kSeals) != 0) posix::throwErrno(op, "sealing " + what);
  return fd;
}

bool isSealed(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  return seals >= 0 && (seals & kSeals) == kSeals;
}

}  // namespace loom::shm
