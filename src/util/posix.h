#pragma once

// Thin helpers over POSIX calls: retry on EINTR, throw loom::Error with errno's text.

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>

namespace loom::posix {

/// Throws Error(kSystem) "<what> failed: <strerror(err)>" for operation `op`.
[[noreturn]] void throwErrno(std::string_view op, std::string_view what, int err = errno);

/// Writes all `n` bytes (MSG_NOSIGNAL for sockets); false on error or peer closed.
bool writeAll(int fd, const void* data, size_t n);

/// Reads exactly `n` bytes; false on error or end of stream.
bool readAll(int fd, void* data, size_t n);

/// std::fopen(path, mode) after making `path`'s folder and its parents where missing (a
/// LOOM_TRACE or dump prefix in a folder not made yet); nullptr, with errno set, if the file
/// cannot be opened.
std::FILE* openMakingFolder(const std::string& path, const char* mode);

/// Closes `fd` if it is >= 0 and sets it to -1.
void closeFd(int& fd);

/// Fills `out` with `n` random bytes from the kernel (getrandom).
void randomBytes(void* out, size_t n);

/// Names the calling thread for top -H, gdb, perf and /proc (at most 15 characters kept),
/// so a user can tell loom's threads apart from theirs.
void nameThisThread(const char* name);

/// An owned file descriptor, closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { closeFd(fd_); }
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      closeFd(fd_);
      fd_ = other.release();
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

}  // namespace loom::posix
