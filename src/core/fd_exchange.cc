// Descriptors between the ranks of one host, through the leader.

#include "core/fd_exchange.h"

#include <unistd.h>

#include <array>
#include <numeric>
#include <vector>

#include "core/process_service.h"
#include "util/unix_socket.h"

namespace loom::detail {

namespace {

using Clock = std::chrono::steady_clock;

// Offers and replies are Welcomes: status 0 carries a descriptor; kRefused says why a rank
// has none; kGone, in a reply, that a rank was lost before it offered.
constexpr int32_t kRefused = 1;
constexpr int32_t kGone = 2;

posix::Fd duplicate(int fd, const FdExchange& x) {
  const int copy = ::dup(fd);
  if (copy < 0) throw Error(ErrorCode::kSystem, x.op, x.rank, "dup of a descriptor failed");
  return posix::Fd(copy);
}

// `who` sent nothing usable: it left, or the deadline passed first.
[[noreturn]] void lost(const FdExchange& x, const std::string& who, Clock::time_point deadline) {
  if (Clock::now() >= deadline) {
    throw Error(ErrorCode::kTimeout, x.op, x.rank,
                "timed out while the host's ranks exchanged device memory, waiting for " + who +
                    "; did it reach the same call?");
  }
  throw Error(ErrorCode::kPeerFailure, x.op, x.rank,
              who + " disconnected while the host's ranks exchanged device memory; did it exit?");
}

[[noreturn]] void refused(const FdExchange& x, const std::string& refusals) {
  throw ExchangeRefused(ErrorCode::kPeerFailure, x.op, x.rank,
                        "the host's ranks could not share device memory: " + refusals +
                            "; fix that rank's device (or run the group without it)");
}

// One rank's refusal as the others read it. A Welcome holds 199 characters, and the leader
// may add " and N more rank(s)": the reason is cut to leave room.
std::string refusalOf(const FdExchange& x, const std::string& why) {
  constexpr size_t kWhy = 140;
  const std::string shown = why.size() > kWhy ? why.substr(0, kWhy - 3) + "..." : why;
  return "rank " + std::to_string(x.rank) + " has none to share (" + shown + ")";
}

std::string localRank(const Arrival& member) {
  return "local rank " + std::to_string(member.hello.rank);
}

// Receives one Welcome (and the descriptor it may carry) from `socket`.
std::optional<std::pair<int32_t, std::string>> receiveWelcome(int socket, posix::Fd* fd,
                                                              Clock::time_point deadline) {
  uint8_t bytes[handshake::kWelcomeBytes];
  if (!unix_socket::recvWithFd(socket, bytes, sizeof bytes, fd, deadline)) return std::nullopt;
  return handshake::parseWelcome(bytes);
}

// The leader's side. `mine` < 0: the leader itself refuses, for `refusal`; it then returns
// an empty vector once the members know. Otherwise `note` goes with `mine`.
std::vector<FdOffer> lead(const FdExchange& x, int mine, const std::string& note,
                          const std::string& refusal, Clock::time_point deadline) {
  std::vector<FdOffer> all(static_cast<size_t>(x.localSize));
  // The exchange's ranks are one host's: named by local index, as its messages do.
  std::vector<int> localIndices(static_cast<size_t>(x.localSize));
  std::iota(localIndices.begin(), localIndices.end(), 0);
  std::vector<Arrival> members = ProcessService::instance().acceptMembers(
      x.id, x.secret, x.localSize - 1, localIndices, deadline);
  const auto welcome = handshake::encodeWelcome(0, "");
  // Members send nothing until welcomed (the service drops an early arrival that does).
  for (Arrival& member : members) {
    if (!unix_socket::sendWithFd(member.socket.get(), welcome.data(), welcome.size(), -1)) {
      lost(x, localRank(member), deadline);
    }
  }
  std::string refusals = mine < 0 ? refusalOf(x, refusal) : "";
  int refusing = mine < 0 ? 1 : 0;
  std::string gone;  // a member that sent no usable offer
  if (mine >= 0) all[0] = {duplicate(mine, x), note};
  for (Arrival& member : members) {
    posix::Fd fd;
    const auto offer = receiveWelcome(member.socket.get(), &fd, deadline);
    if (!offer || (offer->first == 0 && !fd)) {
      if (gone.empty()) gone = localRank(member);
    } else if (offer->first != 0) {
      if (refusing++ == 0) refusals = offer->second;
    } else {
      all[static_cast<size_t>(member.hello.rank)] = {std::move(fd), offer->second};
    }
  }
  if (!gone.empty() || refusing > 0) {
    // Every member learns the outcome before the leader gives up, so none waits for
    // descriptors that will not come.
    if (refusing > 1) refusals += " and " + std::to_string(refusing - 1) + " more rank(s)";
    const auto verdict = gone.empty() ? handshake::encodeWelcome(kRefused, refusals)
                                      : handshake::encodeWelcome(kGone, gone);
    for (Arrival& member : members) {
      // A member that left meanwhile needs no verdict.
      unix_socket::sendWithFd(member.socket.get(), verdict.data(), verdict.size(), -1);
    }
    if (!gone.empty()) lost(x, gone, deadline);
    if (mine < 0) return {};
    refused(x, refusals);
  }
  std::vector<std::array<uint8_t, handshake::kWelcomeBytes>> replies;  // one per offer
  for (const FdOffer& offer : all) replies.push_back(handshake::encodeWelcome(0, offer.note));
  for (Arrival& member : members) {
    for (size_t q = 0; q < all.size(); ++q) {
      if (!unix_socket::sendWithFd(member.socket.get(), replies[q].data(), replies[q].size(),
                                   all[q].fd.get())) {
        lost(x, localRank(member), deadline);
      }
    }
  }
  return all;
}

// A member's side; `mine` < 0 as for lead().
std::vector<FdOffer> join(const FdExchange& x, int mine, const std::string& note,
                          const std::string& refusal, Clock::time_point deadline) {
  handshake::Hello hello;
  hello.comm = x.id;
  hello.secret = x.secret;
  hello.rank = x.localRank;
  hello.pid = static_cast<int32_t>(::getpid());
  posix::Fd socket = ProcessService::instance().introduce(x.leaderAddress, hello, x.rank, deadline);
  posix::Fd none;
  const auto accepted = receiveWelcome(socket.get(), &none, deadline);
  if (!accepted) lost(x, "the leader", deadline);
  if (accepted->first == handshake::kAbandoned) {
    throw Error(ErrorCode::kPeerFailure, x.op, x.rank, accepted->second);  // it gave up
  }
  if (accepted->first != 0) {
    throw Error(ErrorCode::kInternal, x.op, x.rank,
                "the host's leader refused this rank's device memory: " + accepted->second);
  }
  const auto offer = mine >= 0 ? handshake::encodeWelcome(0, note)
                               : handshake::encodeWelcome(kRefused, refusalOf(x, refusal));
  if (!unix_socket::sendWithFd(socket.get(), offer.data(), offer.size(), mine)) {
    lost(x, "the leader", deadline);
  }
  std::vector<FdOffer> all(static_cast<size_t>(x.localSize));
  for (FdOffer& each : all) {
    const auto reply = receiveWelcome(socket.get(), &each.fd, deadline);
    if (!reply) lost(x, "the leader", deadline);
    if (reply->first == kGone) lost(x, reply->second, deadline);
    if (reply->first != 0) {
      if (mine < 0) return {};
      refused(x, reply->second);
    }
    if (!each.fd) lost(x, "the leader", deadline);
    each.note = reply->second;
  }
  return all;
}

}  // namespace

std::vector<FdOffer> exchangeFds(const FdExchange& x, int mine, const std::string& note,
                                 Clock::time_point deadline) {
  if (note.size() > kMaxFdNote) {
    throw Error(ErrorCode::kInternal, x.op, x.rank,
                "a descriptor's note of " + std::to_string(note.size()) + " characters; at most " +
                    std::to_string(kMaxFdNote) + " travel");
  }
  return x.localRank == 0 ? lead(x, mine, note, "", deadline) : join(x, mine, note, "", deadline);
}

void refuseFds(const FdExchange& x, const std::string& why, Clock::time_point deadline) noexcept {
  try {
    if (x.localRank == 0) {
      lead(x, -1, "", why, deadline);
    } else {
      join(x, -1, "", why, deadline);
    }
  } catch (...) {
    // The others are gone or late: they learn of this rank from their own wait. Its caller
    // reports its own error either way.
  }
}

}  // namespace loom::detail
