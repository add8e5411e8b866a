// Abstract-namespace Unix sockets and SCM_RIGHTS.

#include "util/unix_socket.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cstring>

namespace loom::unix_socket {

namespace {

socklen_t abstractAddress(const std::string& name, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof *addr);
  addr->sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof addr->sun_path - 1);
  std::memcpy(addr->sun_path + 1, name.data(), n);  // sun_path[0] = 0: abstract
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

}  // namespace

posix::Fd listenAbstract(const std::string& name) {
  posix::Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) posix::throwErrno("create", "socket(AF_UNIX)");
  sockaddr_un addr;
  const socklen_t length = abstractAddress(name, &addr);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), length) != 0) {
    posix::throwErrno("create", "binding the local socket");
  }
  if (::listen(fd.get(), 1024) != 0) posix::throwErrno("create", "listen on the local socket");
  return fd;
}

posix::Fd connectAbstract(const std::string& name) {
  posix::Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return fd;
  sockaddr_un addr;
  const socklen_t length = abstractAddress(name, &addr);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), length) != 0) return posix::Fd();
  return fd;
}

bool peerCredentials(int socket, unsigned* uid, int* pid) {
  ucred cred{};
  socklen_t length = sizeof cred;
  if (::getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &cred, &length) != 0) return false;
  *uid = cred.uid;
  *pid = cred.pid;
  return true;
}

bool sendWithFd(int socket, const void* data, size_t n, int fdToSend) {
  iovec iov{const_cast<void*>(data), n};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fdToSend >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cmsg), &fdToSend, sizeof(int));
  }
  ssize_t k;
  do {
    k = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
  } while (k < 0 && errno == EINTR);
  if (k < 0) return false;
  // The descriptor went with the first byte; send any remainder plainly.
  return posix::writeAll(socket, static_cast<const char*>(data) + k, n - static_cast<size_t>(k));
}

ssize_t recvSome(int socket, void* data, size_t n, posix::Fd* received) {
  iovec iov{data, n};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t k;
  do {
    k = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
  } while (k < 0 && errno == EINTR);
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); k >= 0 && c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
      *received = posix::Fd(fd);
    }
  }
  return k;
}

bool recvWithFd(int socket, void* data, size_t n, posix::Fd* received,
                std::chrono::steady_clock::time_point deadline) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd pfd{socket, POLLIN, 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (ready < 0 && errno != EINTR) return false;
    if (ready <= 0) continue;
    const ssize_t k = recvSome(socket, p, n, received);
    if (k < 0 && errno == EAGAIN) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool hungUp(int socket) {
  pollfd p{socket, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if ((p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) != 0) return true;
  char byte = 0;
  return (p.revents & POLLIN) != 0 && ::recv(socket, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

}  // namespace loom::unix_socket
