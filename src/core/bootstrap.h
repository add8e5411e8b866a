#pragma once

// Meeting the other ranks through the store. Each rank publishes where it can be reached
// (its process service's socket), its host identity and pid; rank 0 also draws the new
// communicator's id and a job secret, gathers everything into a roster and publishes it.
// That is one set and one get per rank (rank 0: one get per rank), whatever the size.

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/handshake.h"
#include "core/topology.h"
#include "loom/error.h"
#include "loom/store.h"
#include "util/comm_id.h"

namespace loom {

/// How to reach one rank and where it runs.
struct PeerInfo {
  HostId host{};
  HostId machine{};  ///< its kernel (HostInfo::machine): whose cores it shares
  uint64_t pidNamespace = 0;
  int32_t pid = 0;
  std::string hostname;
  std::string address;      ///< its process service's socket name
  std::string netAddress;   ///< where it listens for other hosts ("ip:port"), if it does
  uint64_t cpus = 0;        ///< a fingerprint of the CPUs it may run on (processCpus())
  uint32_t cores = 0;       ///< how many CPUs it may run on (availableCores())
  uint32_t netLanes = 0;    ///< the LOOM_NET_LANES it asks for, 0 where unset
  std::string refusal;      ///< why it cannot join (its own settings are bad); empty if it can
  std::string making;       ///< the name of the communicator it makes (CommOptions::name)
  uint32_t makingSize = 0;  ///< and its size: a round's ranks must all make the same one
  uint32_t gaveUp = 0;      ///< 1: it gave the round up at its timeout, before rank 0 came
};

/// Everything a rank needs to join: the communicator's identity and every rank's PeerInfo.
struct Roster {
  CommId id{};
  handshake::Secret secret{};
  std::vector<PeerInfo> peers;
  /// Set instead of the peers where a rank cannot join: why ("rank 1 cannot join: ..."),
  /// so that every rank refuses at once rather than wait out the timeout for it.
  std::string refusal;
  /// What the refusal is: a rank's bad setting (the default), or kTimeout where rank 0
  /// gave the round up waiting for a rank.
  ErrorCode refusalCode = ErrorCode::kInvalidArgument;
  std::string storePrefix;  ///< the store keys of this exchange (not sent)
};

/// This process's PeerInfo.
PeerInfo localPeer();

Bytes encodePeer(const PeerInfo& peer);
std::optional<PeerInfo> parsePeer(std::span<const uint8_t> bytes);
Bytes encodeRoster(const Roster& roster);
/// Decodes a roster of exactly `size` peers (or none, with a refusal); nullopt if malformed.
std::optional<Roster> parseRoster(std::span<const uint8_t> bytes, int size);

/// Opens this process to other hosts for the communicator of `roster` and returns the
/// address they connect to.
using Listen = std::function<std::string(const Roster&)>;

/// Runs the exchange; every rank returns the same roster. If the ranks span hosts, a second
/// round fills every peer's netAddress with what `listen` returns on that rank (called once
/// the roster is known, before the address is published, so no peer can connect early).
/// Throws Error(kTimeout) naming the ranks that did not show up by `deadline`.
/// `name` (CommOptions::name) must be the same on every rank of the round: ranks that make
/// different communicators through one store at once are refused, naming both.
Roster exchangeRoster(int rank, int size, Store& store,
                      std::chrono::steady_clock::time_point deadline, const Listen& listen,
                      const std::string& name = {});
/// The first round alone (one host, or a caller that opens no network).
Roster exchangeRosterOnly(int rank, int size, Store& store,
                          std::chrono::steady_clock::time_point deadline,
                          const std::string& name = {});

/// Where the roster's ranks run.
HostMap hostMapOf(const Roster& roster);

/// Throws Error(kUnsupported) if rank `rank` would need a link this build cannot make.
void requireSupportedLinks(const Roster& roster, const HostMap& hosts, int rank);

/// "rank 3 (host 'node7', 10.0.0.7:4242)": how messages name a rank of another host.
std::string describeRemote(const Roster& roster, int q);

}  // namespace loom
