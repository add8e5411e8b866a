#pragma once

// Which ranks share a host. Two processes can use loom's shared-memory transport only if
// they share a kernel (boot id) and a network namespace (the abstract socket the segment
// hand-off uses); that pair is the host identity. Environment variables are not trusted for
// this: containers on one machine may report the same hostname and still not share memory.

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace loom {

using HostId = std::array<uint8_t, 16>;

/// This process's host identity.
struct HostInfo {
  HostId id{};
  /// The kernel alone (boot id): processes that share it share the machine's cores, in
  /// whatever network namespace (hosts made of namespaces on one machine, as tests do).
  HostId machine{};
  std::string hostname;
  uint64_t pidNamespace = 0;  ///< inode of /proc/self/ns/pid (pids comparable if equal)
};

/// How two ranks reach each other.
enum class Link : uint8_t {
  kSelf,          ///< the same rank
  kSharedMemory,  ///< ranks of one host
  kNetwork,       ///< ranks of different hosts
};

/// Which ranks of a communicator share a host. Hosts are numbered in order of their lowest
/// rank, and a host's ranks are listed in rank order, so every rank derives the same map.
class HostMap {
 public:
  /// The map of a communicator whose rank r runs on host `hostOfRank[r]`.
  explicit HostMap(std::span<const HostId> hostOfRank);

  int hosts() const { return static_cast<int>(ranksOn_.size()); }
  /// The host rank r runs on.
  int hostOf(int r) const { return hostOf_[r]; }
  /// The ranks of host h, ascending.
  const std::vector<int>& ranksOn(int h) const { return ranksOn_[h]; }
  /// How many ranks share rank r's host (its own included).
  int localRanks(int r) const { return static_cast<int>(ranksOn_[hostOf_[r]].size()); }
  /// Rank r's position among the ranks of its host.
  int localIndex(int r) const { return localIndex_[r]; }
  /// How ranks a and b reach each other.
  Link link(int a, int b) const {
    if (a == b) return Link::kSelf;
    return hostOf_[a] == hostOf_[b] ? Link::kSharedMemory : Link::kNetwork;
  }

 private:
  std::vector<int> hostOf_;
  std::vector<int> localIndex_;
  std::vector<std::vector<int>> ranksOn_;
};

/// Reads this process's host identity now: never cached, since a process may move to
/// another network namespace, or be a fork that does (namespace hosts on one machine).
HostInfo localHost();

/// The CPUs this process may run on, ascending: the affinity mask of the thread that first
/// asks (before loom binds any thread to a part of it; see core/placement.h), cached.
const std::vector<int>& processCpus();

/// How many CPUs this process may run on (processCpus()), at least 1.
int availableCores();

}  // namespace loom
