// TcpStoreServer: one thread, poll() over the listener and every client. A GET for a key
// that is not set yet parks until a SET arrives or its timeout passes. A client that sends
// a malformed or oversized frame is disconnected; nothing it sends can crash the server.

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "loom/error.h"
#include "loom/tcp_store.h"
#include "store/store_protocol.h"
#include "util/posix.h"

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;

struct Client {
  posix::Fd fd;
  Bytes in;
  Bytes out;
  size_t sent = 0;
  bool closing = false;
};

struct ParkedGet {
  int client;
  std::string key;
  Clock::time_point deadline;
};

// How long accepting pauses once the process is out of descriptors.
constexpr auto kAcceptPause = std::chrono::milliseconds(100);

// The server's state; lives on the server thread only.
class Server {
 public:
  Server(int listenFd, int wakeFd) : listenFd_(listenFd), wakeFd_(wakeFd) {}
  void run();

 private:
  void accept();
  void readFrom(int id, Client& client);
  void handle(int id, const store::Request& request);
  void reply(int id, store::Status status, std::span<const uint8_t> payload);
  void flush(Client& client);
  void expireParked(Clock::time_point now);
  int pollTimeoutMs(Clock::time_point now) const;

  int listenFd_;
  int wakeFd_;
  int nextId_ = 0;
  // Out of descriptors (EMFILE, ENFILE), new connections wait in the listener's backlog
  // until then: polled meanwhile, the still-readable listener would spin this thread.
  Clock::time_point acceptPausedUntil_{};
  bool toldOutOfFds_ = false;
  std::map<int, Client> clients_;
  std::map<std::string, Bytes> data_;
  std::vector<ParkedGet> parked_;
};

void Server::run() {
  std::vector<pollfd> fds;
  std::vector<int> ids;
  for (;;) {
    fds.clear();
    ids.clear();
    const bool accepting = Clock::now() >= acceptPausedUntil_;
    fds.push_back({accepting ? listenFd_ : -1, POLLIN, 0});  // -1: poll ignores it
    fds.push_back({wakeFd_, POLLIN, 0});
    for (auto& [id, client] : clients_) {
      short events = POLLIN;
      if (client.sent < client.out.size()) events |= POLLOUT;
      fds.push_back({client.fd.get(), events, 0});
      ids.push_back(id);
    }
    const int n = ::poll(fds.data(), fds.size(), pollTimeoutMs(Clock::now()));
    if (n < 0 && errno != EINTR) return;
    if (fds[1].revents != 0) return;  // asked to stop
    if (fds[0].revents & POLLIN) accept();
    for (size_t i = 2; i < fds.size(); ++i) {
      auto it = clients_.find(ids[i - 2]);
      if (it == clients_.end()) continue;
      Client& client = it->second;
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) readFrom(it->first, client);
      if (!client.closing && (fds[i].revents & POLLOUT)) flush(client);
    }
    expireParked(Clock::now());
    for (auto it = clients_.begin(); it != clients_.end();) {
      if (it->second.closing) {
        const int id = it->first;
        std::erase_if(parked_, [id](const ParkedGet& p) { return p.client == id; });
        it = clients_.erase(it);
      } else {
        ++it;
      }
    }
  }
}

void Server::accept() {
  for (;;) {
    const int fd = ::accept4(listenFd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        acceptPausedUntil_ = Clock::now() + kAcceptPause;
        if (!std::exchange(toldOutOfFds_, true)) {
          std::fprintf(stderr,
                       "loom store server: this process is out of file descriptors with %zu "
                       "clients connected; later ones wait until some leave. Raise the limit "
                       "(ulimit -n) for jobs of this size\n",
                       clients_.size());
        }
      }
      return;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    clients_[nextId_++].fd = posix::Fd(fd);
  }
}

void Server::readFrom(int id, Client& client) {
  uint8_t buffer[64 * 1024];
  for (;;) {
    const ssize_t k = ::read(client.fd.get(), buffer, sizeof buffer);
    if (k > 0) {
      client.in.insert(client.in.end(), buffer, buffer + k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    client.closing = true;  // end of stream or error
    return;
  }
  // Handle every complete frame in the buffer.
  size_t pos = 0;
  while (client.in.size() - pos >= 4) {
    const uint32_t length = store::readLength(client.in.data() + pos);
    if (length > store::kMaxFrameBytes) {
      client.closing = true;
      return;
    }
    if (client.in.size() - pos - 4 < length) break;
    std::span<const uint8_t> body(client.in.data() + pos + 4, length);
    pos += 4 + length;
    const std::optional<store::Request> request = store::parseRequest(body);
    if (!request) {
      client.closing = true;
      return;
    }
    handle(id, *request);
    if (client.closing) return;
  }
  client.in.erase(client.in.begin(), client.in.begin() + static_cast<ptrdiff_t>(pos));
}

void Server::handle(int id, const store::Request& request) {
  using store::Command;
  using store::Status;
  switch (request.command) {
    case Command::kSet: {
      data_[request.key] = request.value;
      reply(id, Status::kOk, {});
      const Bytes& value = data_[request.key];
      std::erase_if(parked_, [&](const ParkedGet& p) {
        if (p.key != request.key) return false;
        reply(p.client, Status::kOk, value);
        return true;
      });
      return;
    }
    case Command::kGet: {
      auto it = data_.find(request.key);
      if (it != data_.end()) {
        reply(id, Status::kOk, it->second);
      } else {
        parked_.push_back(
            {id, request.key, Clock::now() + std::chrono::milliseconds(request.timeoutMs)});
      }
      return;
    }
    case Command::kAdd: {
      Bytes& bytes = data_[request.key];
      const std::optional<int64_t> current = store::parseCounter(bytes);
      if (!current) {
        reply(id, Status::kBadRequest, {});
        return;
      }
      const int64_t value = static_cast<int64_t>(static_cast<uint64_t>(*current) +
                                                 static_cast<uint64_t>(request.delta));
      const std::string text = std::to_string(value);
      bytes.assign(text.begin(), text.end());
      Bytes payload;
      store::putI64(payload, value);
      reply(id, Status::kOk, payload);
      // An ADD also sets the key: wake GETs parked on it.
      std::erase_if(parked_, [&](const ParkedGet& p) {
        if (p.key != request.key) return false;
        reply(p.client, Status::kOk, bytes);
        return true;
      });
      return;
    }
    case Command::kCheck: {
      const uint8_t found = data_.count(request.key) != 0 ? 1 : 0;
      reply(id, Status::kOk, std::span<const uint8_t>(&found, 1));
      return;
    }
    case Command::kErase: {
      const uint8_t found = data_.erase(request.key) != 0 ? 1 : 0;
      reply(id, Status::kOk, std::span<const uint8_t>(&found, 1));
      return;
    }
  }
}

void Server::reply(int id, store::Status status, std::span<const uint8_t> payload) {
  auto it = clients_.find(id);
  if (it == clients_.end() || it->second.closing) return;
  const Bytes frame = store::encodeResponse(status, payload);
  it->second.out.insert(it->second.out.end(), frame.begin(), frame.end());
  flush(it->second);
}

void Server::flush(Client& client) {
  while (client.sent < client.out.size()) {
    const ssize_t k = ::send(client.fd.get(), client.out.data() + client.sent,
                             client.out.size() - client.sent, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (k <= 0) {
      client.closing = true;
      return;
    }
    client.sent += static_cast<size_t>(k);
  }
  client.out.clear();
  client.sent = 0;
}

void Server::expireParked(Clock::time_point now) {
  std::erase_if(parked_, [&](const ParkedGet& p) {
    if (p.deadline > now) return false;
    reply(p.client, store::Status::kTimeout, {});
    return true;
  });
}

int Server::pollTimeoutMs(Clock::time_point now) const {
  int timeout = -1;
  if (now < acceptPausedUntil_) {  // back to accepting then
    timeout = static_cast<int>(
        std::chrono::ceil<std::chrono::milliseconds>(acceptPausedUntil_ - now).count());
  }
  for (const ParkedGet& p : parked_) {
    const auto ms = std::chrono::ceil<std::chrono::milliseconds>(p.deadline - now).count();
    const int clamped = ms < 0 ? 0 : static_cast<int>(std::min<int64_t>(ms, 60'000));
    if (timeout < 0 || clamped < timeout) timeout = clamped;
  }
  return timeout;
}

}  // namespace

TcpStoreServer::TcpStoreServer(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  const int rc =
      ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &result);
  if (rc != 0) {
    throw Error(ErrorCode::kInvalidArgument, "store server", -1,
                "cannot resolve host '" + host + "': " + ::gai_strerror(rc));
  }
  int lastErrno = 0;
  for (addrinfo* ai = result; ai != nullptr && listenFd_ < 0; ai = ai->ai_next) {
    posix::Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) continue;
    const int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd.get(), 1024) == 0) {
      listenFd_ = fd.release();
    } else {
      lastErrno = errno;
    }
  }
  ::freeaddrinfo(result);
  if (listenFd_ < 0) {
    posix::throwErrno("store server", "binding " + host + ":" + service, lastErrno);
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof bound;
  ::getsockname(listenFd_, reinterpret_cast<sockaddr*>(&bound), &length);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  wakeFd_ = ::eventfd(0, EFD_CLOEXEC);
  if (wakeFd_ < 0) posix::throwErrno("store server", "eventfd");
}

TcpStoreServer::~TcpStoreServer() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t k = ::write(wakeFd_, &one, sizeof one);
    thread_.join();
  }
  posix::closeFd(listenFd_);
  posix::closeFd(wakeFd_);
}

void TcpStoreServer::start() {
  thread_ = std::thread([this] {
    posix::nameThisThread("loom-store");
    Server(listenFd_, wakeFd_).run();
  });
}

void TcpStoreServer::closeInChild() {
  posix::closeFd(listenFd_);
  posix::closeFd(wakeFd_);
}

}  // namespace loom
