// Each rank of a host on CPUs of its own (see placement.h).

#include "core/placement.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "util/helper_pool.h"

namespace loom {

uint64_t cpuFingerprint(std::span<const int> cpus) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the CPU numbers
  for (int c : cpus) {
    for (int shift = 0; shift < 32; shift += 8) {
      h ^= static_cast<uint64_t>((static_cast<uint32_t>(c) >> shift) & 0xff);
      h *= 0x100000001b3ull;
    }
  }
  return h;
}

Placement choosePlacement(const Roster& roster, const HostMap& hosts, int rank,
                          std::span<const int> cpus, int threads) {
  const std::vector<int>& here = hosts.ranksOn(hosts.hostOf(rank));
  const int local = static_cast<int>(here.size());
  if (local < 2) return {{}, "the only rank on its host"};
  if (hosts.hosts() > 1) return {{}, "the communicator spans hosts"};
  const PeerInfo& mine = roster.peers[rank];
  for (size_t i = 0; i < here.size(); ++i) {
    const PeerInfo& peer = roster.peers[here[i]];
    if (peer.cpus != mine.cpus) {
      return {{}, "the ranks of this host may run on different CPUs (placed by the launcher)"};
    }
    for (size_t j = 0; j < i; ++j) {
      const PeerInfo& other = roster.peers[here[j]];
      if (other.pid == peer.pid && other.pidNamespace == peer.pidNamespace) {
        return {{},
                "ranks " + std::to_string(here[j]) + " and " + std::to_string(here[i]) +
                    " are threads of one process"};
      }
    }
  }
  const int share = static_cast<int>(cpus.size()) / local;
  if (share < std::max(1, threads)) {
    return {{},
            std::to_string(cpus.size()) + " CPUs for " + std::to_string(local) + " ranks of " +
                std::to_string(threads) + " threads: a block would be too small"};
  }
  const int index = hosts.localIndex(rank);
  std::vector<int> block(cpus.begin() + index * share, cpus.begin() + (index + 1) * share);
  return {block, "local rank " + std::to_string(index) + " of " + std::to_string(local) +
                     ": CPUs " + std::to_string(block.front()) + "-" +
                     std::to_string(block.back()) + " of the " + std::to_string(cpus.size()) +
                     " its host's ranks share"};
}

bool openMpBindsThreads() {
  const char* bind = std::getenv("OMP_PROC_BIND");
  if (bind != nullptr && *bind != '\0' && ::strcasecmp(bind, "false") != 0) return true;
  for (const char* name : {"GOMP_CPU_AFFINITY", "KMP_AFFINITY"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') return true;
  }
  return false;
}

namespace {

Placement bindThisRank(const Roster& roster, const HostMap& hosts, int rank, int threads) {
  if (openMpBindsThreads()) {
    return {{}, "OpenMP binds threads (OMP_PROC_BIND, GOMP_CPU_AFFINITY or KMP_AFFINITY)"};
  }
  Placement placed = choosePlacement(roster, hosts, rank, processCpus(), threads);
  if (placed.cpus.empty()) return placed;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : placed.cpus) CPU_SET(c, &set);
  // A thread's mask only: the process's other threads (its store, torch's pools started
  // before) keep theirs; threads started from this one inherit the block.
  if (::pthread_setaffinity_np(::pthread_self(), sizeof set, &set) != 0) {
    return {{}, "binding the calling thread failed"};
  }
  HelperPool::instance().bindTo(set);
  return placed;
}

}  // namespace

const Placement& placeThisRank(const Roster& roster, const HostMap& hosts, int rank, int threads) {
  static std::mutex mutex;
  static Placement placed;
  static pid_t decidedBy = 0;  // a forked child decides for itself
  std::lock_guard<std::mutex> lock(mutex);
  if (decidedBy == ::getpid()) return placed;
  decidedBy = ::getpid();
  placed = bindThisRank(roster, hosts, rank, threads);
  if (placed.cpus.empty()) {
    // The user asked for binding: say why this rank did not get it.
    std::fprintf(stderr, "loom: LOOM_BIND=1: rank %d keeps the CPUs it was given: %s\n", rank,
                 placed.reason.c_str());
  }
  return placed;
}

}  // namespace loom
