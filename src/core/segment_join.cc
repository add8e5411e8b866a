// A communicator's host segment made and handed over: the leader's side and the members'
// (ARCHITECTURE.md, "Segment hand-off"), apart from the rest of CommState.

#include "core/comm_state.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <span>

#include "core/handshake.h"
#include "core/process_service.h"
#include "util/unix_socket.h"

namespace loom::detail {

using Clock = std::chrono::steady_clock;

CommState::JoinedSegment CommState::joinSegment(Clock::time_point deadline, bool child,
                                                const ParentWatch& parent) {
  // The segment holds this host's ranks, at their local index; each host's has its own id.
  // The host's lowest rank makes it and hands it to the others.
  const int host = hosts_.hostOf(rank_);
  const std::vector<int>& here = hosts_.ranksOn(host);
  const int localRank = hosts_.localIndex(rank_);
  const int localSize = static_cast<int>(here.size());
  const CommId segmentId =
      spansHosts() ? deriveId(roster_.id, "host/" + std::to_string(host)) : roster_.id;
  ProcessService& service = ProcessService::instance();
  // A member that dies while the others gather (or one a shrink kept, already dead) ends
  // every rank's wait at once, named, instead of at the creation's deadline.
  const PeerInfo& self = roster_.peers[rank_];
  std::vector<std::pair<int, int>> others;
  for (int q : here) {
    const PeerInfo& peer = roster_.peers[q];
    if (q != rank_ && peer.pidNamespace == self.pidNamespace) others.emplace_back(q, peer.pid);
  }
  const ExitWatch watch(others);
  const auto stillAlive = [&] {
    if (parent.stops()) throw parent.failures->sparingError(parent.members, "create");
    if (const auto gone = watch.exited()) {
      throw Error(ErrorCode::kPeerFailure, "create", rank_,
                  "rank " + std::to_string(gone->first) + " (pid " + std::to_string(gone->second) +
                      ") exited while this communicator was being made; " +
                      (child ? "make it without that rank (shrink) or restart the job"
                             : "restart the job"));
    }
  };
  if (localRank != 0) {
    handshake::Hello hello;
    hello.comm = segmentId;
    hello.secret = roster_.secret;
    hello.rank = localRank;
    hello.pid = static_cast<int32_t>(::getpid());
    ProcessService::Welcomed welcomed =
        service.joinLeader(roster_.peers[here[0]].address, hello, rank_, deadline, stillAlive);
    auto segment = shm::Segment::attach(std::move(welcomed.segment), segmentId, localSize,
                                        static_cast<int>(roster_.peers.size()));
    ProcessService::confirmJoined(welcomed);
    return {std::move(segment), std::nullopt};
  }
  std::shared_ptr<shm::Segment> segment;
  try {
    const auto layout = shm::Layout::compute(localSize, static_cast<int>(roster_.peers.size()),
                                             config_.chunkBytes, config_.ringBytes);
    segment = shm::Segment::create(layout, segmentId);
  } catch (const Error& e) {
    service.abandon(segmentId, "the leader of this communicator, rank " + std::to_string(rank_) +
                                   ", could not make its shared segment: " + e.detail());
    throw;
  }
  std::vector<Arrival> members = service.acceptMembers(
      segmentId, roster_.secret, localSize - 1, here, deadline, stillAlive,
      child ? "did every member make this group (the same ranks, as many times as the others), "
              "or did one fail earlier?"
            : ProcessService::kStoreHint);
  const auto refuse = [&](std::span<const Arrival> whom, const std::string& why) {
    const std::string reason = ProcessService::leaderGaveUp(rank_, why);
    for (const Arrival& member : whom)
      ProcessService::refuse(member, handshake::kAbandoned, reason);
  };
  // Deadlines differ by rank (each counts from its own call): a member whose deadline passed
  // while others were still coming has given up and hung up. Nobody is handed the segment
  // then: every member learns why now, instead of one holding a communicator that a rank
  // never joined.
  for (const Arrival& member : members) {
    if (!unix_socket::hungUp(member.socket.get())) continue;
    const std::string why = "rank " + std::to_string(here[member.hello.rank]) +
                            " gave up joining before every rank had come";
    refuse(members, why);
    throw Error(ErrorCode::kTimeout, "create", rank_,
                why +
                    " (its own timeout ran out first); make the communicator again, with a "
                    "timeout that covers the ranks' different start times");
  }
  const auto welcome = handshake::encodeWelcome(0, "");
  std::optional<std::pair<int, std::string>> broken;
  for (size_t i = 0; i < members.size() && !broken; ++i) {
    const int rank = here[members[i].hello.rank];
    if (!unix_socket::sendWithFd(members[i].socket.get(), welcome.data(), welcome.size(),
                                 segment->fd())) {
      broken = {rank, "rank " + std::to_string(rank) + " disconnected while joining; did it exit?"};
      refuse(std::span(members).subspan(i + 1), broken->second);
    }
  }
  // Each member says when it holds the segment: one that left before it could (its own
  // deadline, or it died) would otherwise leave the others with a communicator it never
  // joined. A live member confirms at once; the grace covers a slow machine.
  const auto confirmBy = std::max(deadline, Clock::now() + std::chrono::seconds(10));
  for (size_t i = 0; i < members.size() && !broken; ++i) {
    const int rank = here[members[i].hello.rank];
    uint8_t joined = 0;
    posix::Fd none;
    if (!unix_socket::recvWithFd(members[i].socket.get(), &joined, 1, &none, confirmBy)) {
      broken = {rank, "rank " + std::to_string(rank) +
                          " left while joining, before it held the shared segment (its own "
                          "timeout ran out, it could not map it, or it exited); make the "
                          "communicator again"};
    }
  }
  return {std::move(segment), std::move(broken)};
}

}  // namespace loom::detail
