// Descriptors between the ranks of one host, through the leader.

#include "core/fd_exchange.h"

#include <unistd.h>

#include "core/process_service.h"
#include "loom/error.h"
#include "util/unix_socket.h"

namespace loom::detail {

namespace {

constexpr uint64_t kOfferMagic = 0x7265666f2d6d6f6fULL;  // "oom-ofer"

posix::Fd duplicate(int fd, const FdExchange& x) {
  const int copy = ::dup(fd);
  if (copy < 0) throw Error(ErrorCode::kSystem, x.op, x.rank, "dup of a descriptor failed");
  return posix::Fd(copy);
}

[[noreturn]] void lost(const FdExchange& x, const std::string& who) {
  throw Error(ErrorCode::kPeerFailure, x.op, x.rank,
              who + " disconnected while the host's ranks exchanged device memory; did it exit?");
}

}  // namespace

std::vector<posix::Fd> exchangeFds(const FdExchange& x, int mine,
                                   std::chrono::steady_clock::time_point deadline) {
  std::vector<posix::Fd> all(static_cast<size_t>(x.localSize));
  ProcessService& service = ProcessService::instance();
  const auto welcome = handshake::encodeWelcome(0, "");
  if (x.localRank == 0) {
    std::vector<Arrival> members =
        service.acceptMembers(x.id, x.secret, x.localSize - 1, x.localSize, deadline);
    all[0] = duplicate(mine, x);
    // Members send nothing until welcomed (the service drops an early arrival that does).
    for (Arrival& member : members) {
      if (!unix_socket::sendWithFd(member.socket.get(), welcome.data(), welcome.size(), -1)) {
        lost(x, "local rank " + std::to_string(member.hello.rank));
      }
    }
    for (Arrival& member : members) {
      uint64_t magic = 0;
      posix::Fd fd;
      if (!unix_socket::recvWithFd(member.socket.get(), &magic, sizeof magic, &fd, deadline) ||
          magic != kOfferMagic || !fd) {
        lost(x, "local rank " + std::to_string(member.hello.rank));
      }
      all[static_cast<size_t>(member.hello.rank)] = std::move(fd);
    }
    for (Arrival& member : members) {
      for (const posix::Fd& fd : all) {
        if (!unix_socket::sendWithFd(member.socket.get(), welcome.data(), welcome.size(),
                                     fd.get())) {
          lost(x, "local rank " + std::to_string(member.hello.rank));
        }
      }
    }
    return all;
  }
  handshake::Hello hello;
  hello.comm = x.id;
  hello.secret = x.secret;
  hello.rank = x.localRank;
  hello.pid = static_cast<int32_t>(::getpid());
  posix::Fd socket = service.introduce(x.leaderAddress, hello, deadline);
  uint8_t accepted[handshake::kWelcomeBytes];
  posix::Fd none;
  if (!unix_socket::recvWithFd(socket.get(), accepted, sizeof accepted, &none, deadline)) {
    lost(x, "the leader");
  }
  const auto verdict = handshake::parseWelcome(accepted);
  if (!verdict || verdict->first != 0) {
    throw Error(ErrorCode::kInternal, x.op, x.rank,
                "the host's leader refused this rank's device memory: " +
                    (verdict ? verdict->second : std::string("bad reply")));
  }
  const uint64_t magic = kOfferMagic;
  if (!unix_socket::sendWithFd(socket.get(), &magic, sizeof magic, mine)) lost(x, "the leader");
  for (posix::Fd& fd : all) {
    uint8_t reply[handshake::kWelcomeBytes];
    if (!unix_socket::recvWithFd(socket.get(), reply, sizeof reply, &fd, deadline) || !fd) {
      lost(x, "the leader");
    }
  }
  return all;
}

}  // namespace loom::detail
