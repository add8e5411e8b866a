// Descriptors between the ranks of one host, through the leader.

#include "core/fd_exchange.h"

#include <unistd.h>

#include "core/process_service.h"
#include "loom/error.h"
#include "util/unix_socket.h"

namespace loom::detail {

namespace {

using Clock = std::chrono::steady_clock;

// Offers and replies are Welcomes: status 0 carries a descriptor, anything else a refusal.
constexpr int32_t kRefused = 1;

posix::Fd duplicate(int fd, const FdExchange& x) {
  const int copy = ::dup(fd);
  if (copy < 0) throw Error(ErrorCode::kSystem, x.op, x.rank, "dup of a descriptor failed");
  return posix::Fd(copy);
}

[[noreturn]] void lost(const FdExchange& x, const std::string& who) {
  throw Error(ErrorCode::kPeerFailure, x.op, x.rank,
              who + " disconnected while the host's ranks exchanged device memory; did it exit?");
}

[[noreturn]] void refused(const FdExchange& x, const std::string& refusals) {
  throw Error(ErrorCode::kPeerFailure, x.op, x.rank,
              "the host's ranks could not share device memory: " + refusals +
                  "; fix that rank's device (or run the group without it) and call again");
}

// One rank's refusal as the others read it (a Welcome holds 199 characters of it).
std::string refusalOf(const FdExchange& x, const std::string& why) {
  return "rank " + std::to_string(x.rank) + " has none to share (" + why + ")";
}

// Receives one Welcome (and the descriptor it may carry) from `socket`.
std::optional<std::pair<int32_t, std::string>> receiveWelcome(int socket, posix::Fd* fd,
                                                              Clock::time_point deadline) {
  uint8_t bytes[handshake::kWelcomeBytes];
  if (!unix_socket::recvWithFd(socket, bytes, sizeof bytes, fd, deadline)) return std::nullopt;
  return handshake::parseWelcome(bytes);
}

// The leader's side. `mine` < 0: the leader itself refuses, for `refusal`; it then returns
// an empty vector once the members know.
std::vector<posix::Fd> lead(const FdExchange& x, int mine, const std::string& refusal,
                            Clock::time_point deadline) {
  std::vector<posix::Fd> all(static_cast<size_t>(x.localSize));
  std::vector<Arrival> members = ProcessService::instance().acceptMembers(
      x.id, x.secret, x.localSize - 1, x.localSize, deadline);
  const auto welcome = handshake::encodeWelcome(0, "");
  // Members send nothing until welcomed (the service drops an early arrival that does).
  for (Arrival& member : members) {
    if (!unix_socket::sendWithFd(member.socket.get(), welcome.data(), welcome.size(), -1)) {
      lost(x, "local rank " + std::to_string(member.hello.rank));
    }
  }
  std::string refusals = mine < 0 ? refusalOf(x, refusal) : "";
  int refusing = mine < 0 ? 1 : 0;
  if (mine >= 0) all[0] = duplicate(mine, x);
  for (Arrival& member : members) {
    posix::Fd fd;
    const auto offer = receiveWelcome(member.socket.get(), &fd, deadline);
    if (!offer || (offer->first == 0 && !fd)) {
      lost(x, "local rank " + std::to_string(member.hello.rank));
    }
    if (offer->first != 0) {
      if (refusing++ == 0) refusals = offer->second;
      continue;
    }
    all[static_cast<size_t>(member.hello.rank)] = std::move(fd);
  }
  if (refusing > 0) {
    if (refusing > 1) refusals += " and " + std::to_string(refusing - 1) + " more rank(s)";
    const auto verdict = handshake::encodeWelcome(kRefused, refusals);
    for (Arrival& member : members) {
      // A member that left meanwhile needs no verdict.
      unix_socket::sendWithFd(member.socket.get(), verdict.data(), verdict.size(), -1);
    }
    if (mine < 0) return {};
    refused(x, refusals);
  }
  for (Arrival& member : members) {
    for (const posix::Fd& fd : all) {
      if (!unix_socket::sendWithFd(member.socket.get(), welcome.data(), welcome.size(), fd.get())) {
        lost(x, "local rank " + std::to_string(member.hello.rank));
      }
    }
  }
  return all;
}

// A member's side; `mine` < 0 as for lead().
std::vector<posix::Fd> join(const FdExchange& x, int mine, const std::string& refusal,
                            Clock::time_point deadline) {
  handshake::Hello hello;
  hello.comm = x.id;
  hello.secret = x.secret;
  hello.rank = x.localRank;
  hello.pid = static_cast<int32_t>(::getpid());
  posix::Fd socket = ProcessService::instance().introduce(x.leaderAddress, hello, deadline);
  posix::Fd none;
  const auto accepted = receiveWelcome(socket.get(), &none, deadline);
  if (!accepted) lost(x, "the leader");
  if (accepted->first != 0) {
    throw Error(ErrorCode::kInternal, x.op, x.rank,
                "the host's leader refused this rank's device memory: " + accepted->second);
  }
  const auto offer = mine >= 0 ? handshake::encodeWelcome(0, "")
                               : handshake::encodeWelcome(kRefused, refusalOf(x, refusal));
  if (!unix_socket::sendWithFd(socket.get(), offer.data(), offer.size(), mine)) {
    lost(x, "the leader");
  }
  std::vector<posix::Fd> all(static_cast<size_t>(x.localSize));
  for (posix::Fd& fd : all) {
    const auto reply = receiveWelcome(socket.get(), &fd, deadline);
    if (!reply) lost(x, "the leader");
    if (reply->first != 0) {
      if (mine < 0) return {};
      refused(x, reply->second);
    }
    if (!fd) lost(x, "the leader");
  }
  return all;
}

}  // namespace

std::vector<posix::Fd> exchangeFds(const FdExchange& x, int mine, Clock::time_point deadline) {
  return x.localRank == 0 ? lead(x, mine, "", deadline) : join(x, mine, "", deadline);
}

void refuseFds(const FdExchange& x, const std::string& why, Clock::time_point deadline) noexcept {
  try {
    if (x.localRank == 0) {
      lead(x, -1, why, deadline);
    } else {
      join(x, -1, why, deadline);
    }
  } catch (...) {
    // The others are gone or late: they learn of this rank from their own wait. Its caller
    // reports its own error either way.
  }
}

}  // namespace loom::detail
