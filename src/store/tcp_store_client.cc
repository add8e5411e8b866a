// TcpStore: a blocking client of TcpStoreServer.

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <thread>

#include "loom/error.h"
#include "loom/tcp_store.h"
#include "store/store_protocol.h"
#include "util/deadline.h"
#include "util/posix.h"

namespace loom {

namespace {

// One connection attempt to any address of host:port; -1 if none accepted.
int tryConnect(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &result) != 0) return -1;
  int connected = -1;
  for (addrinfo* ai = result; ai != nullptr && connected < 0; ai = ai->ai_next) {
    posix::Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0));
    if (fd && ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0) connected = fd.release();
  }
  ::freeaddrinfo(result);
  return connected;
}

// What the server refuses (store_protocol.cc's parseRequest) checked here, where the caller
// learns why: the server would only close the connection, which reads as a lost server.
store::Request checkedRequest(store::Command command, const char* op, const std::string& key,
                              size_t valueBytes = 0) {
  if (key.empty()) throw Error(ErrorCode::kInvalidArgument, op, -1, "the key is empty");
  if (key.size() > store::kMaxKeyBytes) {
    throw Error(ErrorCode::kInvalidArgument, op, -1,
                "the key has " + std::to_string(key.size()) +
                    " bytes; the store takes keys of up to " + std::to_string(store::kMaxKeyBytes));
  }
  if (valueBytes > store::kMaxValueBytes) {
    throw Error(ErrorCode::kInvalidArgument, op, -1,
                "the value of '" + key + "' has " + std::to_string(valueBytes) +
                    " bytes; the store takes values of up to " +
                    std::to_string(store::kMaxValueBytes) + " (64 MiB): keep large data elsewhere");
  }
  return store::Request::of(command, key);
}

}  // namespace

TcpStore::TcpStore(const std::string& host, uint16_t port, std::chrono::milliseconds timeout,
                   std::chrono::milliseconds replyMargin)
    : host_(host),
      port_(port),
      endpoint_(host + ":" + std::to_string(port)),
      replyMargin_(replyMargin) {
  if (replyMargin <= std::chrono::milliseconds(0)) {
    throw Error(
        ErrorCode::kInvalidArgument, "store connect", -1,
        "the reply margin must be positive (got " + std::to_string(replyMargin.count()) + " ms)");
  }
  idle_.push_back(connectOnce(timeout));
}

TcpStore::~TcpStore() {
  for (int& fd : idle_) posix::closeFd(fd);
}

int TcpStore::connectOnce(std::chrono::milliseconds timeout) {
  const auto deadline = deadlineAfter(timeout);
  auto pause = std::chrono::milliseconds(1);
  int fd;
  while ((fd = tryConnect(host_, port_)) < 0) {
    if (std::chrono::steady_clock::now() >= deadline) {
      throw Error(ErrorCode::kTimeout, "store connect", -1,
                  "no store server answered at " + endpoint_ + " within " +
                      std::to_string(timeout.count()) +
                      " ms; check MASTER_ADDR/MASTER_PORT and that rank 0 started");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

Bytes TcpStore::roundTrip(const Bytes& request, const char* what,
                          std::chrono::milliseconds serverWait) {
  int fd = -1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!idle_.empty()) {
      fd = idle_.back();
      idle_.pop_back();
    }
  }
  if (fd < 0) fd = connectOnce(std::chrono::seconds(30));
  // On any failure the connection is dropped (a half-read reply would desynchronise it).
  posix::Fd guard(fd);
  auto lost = [&] {
    return Error(ErrorCode::kPeerFailure, what, -1,
                 "lost the connection to the store server at " + endpoint_);
  };
  // Bounded: a server that is gone without a word (its host died, or a link went down)
  // would otherwise hold this read forever.
  // (Per read and write call: each partial transfer starts the window again.)
  constexpr int64_t kMostMs = int64_t{1} << 40;  // about 35 years: no sum overflows
  const int64_t ms = std::clamp<int64_t>(serverWait.count(), 0, kMostMs) +
                     std::min<int64_t>(replyMargin_.count(), kMostMs);
  timeval limit{};
  limit.tv_sec = static_cast<time_t>(ms / 1000);
  limit.tv_usec = static_cast<suseconds_t>(ms % 1000 * 1000);
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit) != 0 ||
      ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit) != 0) {
    throw Error(ErrorCode::kSystem, what, -1,
                std::string("could not bound the store's reply time: ") + std::strerror(errno));
  }
  // A server gone silent is a lost peer to the caller (kPeerFailure, as a closed connection
  // is), not a key that was not set in time (kTimeout, which creation reads as late ranks).
  auto failed = [&] {
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return Error(ErrorCode::kPeerFailure, what, -1,
                   "the store server at " + endpoint_ + " did not answer within " +
                       std::to_string(ms) +
                       " ms; its host may be gone or cut off (the store lives with rank 0, "
                       "MASTER_ADDR)");
    }
    return lost();
  };
  uint8_t header[4];
  errno = 0;
  if (!posix::writeAll(fd, request.data(), request.size()) || !posix::readAll(fd, header, 4)) {
    throw failed();
  }
  const uint32_t length = store::readLength(header);
  if (length == 0 || length > store::kMaxFrameBytes) {
    throw Error(ErrorCode::kInternal, what, -1, "malformed reply from the store at " + endpoint_);
  }
  Bytes body(length);
  errno = 0;
  if (!posix::readAll(fd, body.data(), length)) throw failed();
  std::lock_guard<std::mutex> lock(mutex_);
  idle_.push_back(guard.release());
  return body;
}

void TcpStore::set(const std::string& key, const Bytes& value) {
  store::Request request = checkedRequest(store::Command::kSet, "store set", key, value.size());
  request.value = value;
  roundTrip(store::encodeRequest(request), "store set");
}

Bytes TcpStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  store::Request request = checkedRequest(store::Command::kGet, "store get", key);
  // A timeout of 0 or less has passed already (as HashStore's): the server answers at once.
  request.timeoutMs =
      static_cast<uint32_t>(std::clamp<int64_t>(timeout.count(), 0, int64_t{UINT32_MAX}));
  Bytes body = roundTrip(store::encodeRequest(request), "store get",
                         std::chrono::milliseconds(request.timeoutMs));
  if (body[0] == static_cast<uint8_t>(store::Status::kTimeout)) {
    throw Error(ErrorCode::kTimeout, "store get", -1,
                "key '" + key + "' was not set within " + std::to_string(timeout.count()) +
                    " ms; did every rank start?");
  }
  body.erase(body.begin());
  return body;
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  store::Request request = checkedRequest(store::Command::kAdd, "store add", key);
  request.delta = delta;
  const Bytes body = roundTrip(store::encodeRequest(request), "store add");
  if (body[0] != static_cast<uint8_t>(store::Status::kOk) || body.size() != 9) {
    throw Error(ErrorCode::kInvalidArgument, "store add", -1,
                "key '" + key + "' holds a value that is not a counter");
  }
  return store::getI64(body.data() + 1);
}

bool TcpStore::check(const std::string& key) {
  const Bytes body =
      roundTrip(store::encodeRequest(checkedRequest(store::Command::kCheck, "store check", key)),
                "store check");
  return body.size() == 2 && body[1] == 1;
}

bool TcpStore::erase(const std::string& key) {
  const Bytes body =
      roundTrip(store::encodeRequest(checkedRequest(store::Command::kErase, "store erase", key)),
                "store erase");
  return body.size() == 2 && body[1] == 1;
}

}  // namespace loom
