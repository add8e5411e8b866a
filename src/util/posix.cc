// POSIX helpers shared by the store, the bootstrap and the transport.

#include "util/posix.h"

#include <pthread.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>

#include "loom/error.h"

namespace loom::posix {

void throwErrno(std::string_view op, std::string_view what, int err) {
  throw Error(ErrorCode::kSystem, op, -1, std::string(what) + " failed: " + std::strerror(err));
}

bool writeAll(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == ENOTSOCK) k = ::write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool readAll(int fd, void* data, size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = ::read(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

std::FILE* openMakingFolder(const std::string& path, const char* mode) {
  std::error_code ignored;  // a folder that cannot be made fails the open, with its errno
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  if (!folder.empty()) std::filesystem::create_directories(folder, ignored);
  return std::fopen(path.c_str(), mode);
}

void closeFd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

void randomBytes(void* out, size_t n) {
  auto* p = static_cast<char*>(out);
  while (n > 0) {
    const ssize_t k = ::getrandom(p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) throwErrno("random", "getrandom");
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void nameThisThread(const char* name) {
  char truncated[16];
  std::snprintf(truncated, sizeof truncated, "%s", name);
  ::pthread_setname_np(::pthread_self(), truncated);
}

}  // namespace loom::posix
