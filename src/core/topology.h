#pragma once

// Which ranks share a host. Two processes can use loom's shared-memory transport only if
// they share a kernel (boot id) and a network namespace (the abstract socket the segment
// hand-off uses); that pair is the host identity. Environment variables are not trusted for
// this: containers on one machine may report the same hostname and still not share memory.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace loom {

using HostId = std::array<uint8_t, 16>;

/// This process's host identity.
struct HostInfo {
  HostId id{};
  std::string hostname;
  uint64_t pidNamespace = 0;  ///< inode of /proc/self/ns/pid (pids comparable if equal)
};

/// Reads this process's host identity (cached after the first call).
const HostInfo& localHost();

/// CPUs this process may run on (its affinity mask), at least 1.
int availableCores();

}  // namespace loom
