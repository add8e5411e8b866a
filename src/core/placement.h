#pragma once

// Where a rank's threads run, when asked (LOOM_BIND=1). Ranks of one host that leave their
// threads to the scheduler end up, now and then, with two busy threads on one CPU, and a
// collective then runs at the pace of the rank whose copies got half a CPU: traced on a
// 16-core host, the slow blocks of all_reduce calls from 512 KiB to 8 MiB were those with a
// shared CPU. Ranks kept to CPUs of their own never shared one, but were not faster overall
// in the next run (P = 8 reduce_scatter 1.2-1.4x slower, other points both ways;
// docs/PERFORMANCE.md, "Ranks on CPUs of their own"), so binding is the user's choice, as
// DeepSpeed's --bind_cores_to_rank is, not loom's default.
//
// Asked, the first communicator of a process that shares a host with other ranks gives each
// of them its own block of the CPUs they may all use (local rank i: the i-th of equal
// blocks) and binds there the thread that made it (its later threads, torch's included,
// inherit the mask) and loom's helper threads. Left alone where the ranks were placed by
// someone else (their CPU sets differ), where OpenMP binds threads itself, where ranks are
// threads of one process, where the communicator spans hosts (network namespaces on one
// machine share CPUs that the host map does not show), and where a block would hold fewer
// CPUs than the rank's threads (LOOM_THREADS: the caller and its helpers).

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/bootstrap.h"
#include "core/topology.h"

namespace loom {

/// The CPUs a rank keeps to, or none, and why.
struct Placement {
  std::vector<int> cpus;  ///< empty: loom leaves this rank's threads where they are
  std::string reason;     ///< how the block was chosen, or why there is none
};

/// A fingerprint of a CPU list, which ranks compare to learn whether they got the same CPUs.
uint64_t cpuFingerprint(std::span<const int> cpus);

/// The block rank `rank` of `roster` should keep to, given this process's CPUs and the
/// threads (caller and helpers) each rank runs. Pure: reads nothing but its arguments.
Placement choosePlacement(const Roster& roster, const HostMap& hosts, int rank,
                          std::span<const int> cpus, int threads);

/// Whether OpenMP is told to bind its threads (OMP_PROC_BIND, GOMP_CPU_AFFINITY,
/// KMP_AFFINITY): then the user has placed the threads, and loom does not.
bool openMpBindsThreads();

/// Once per process: chooses this rank's block and binds the calling thread and loom's
/// helper threads to it, or says on stderr why it binds nothing. Returns what was chosen (the
/// first call's choice on later calls).
const Placement& placeThisRank(const Roster& roster, const HostMap& hosts, int rank, int threads);

}  // namespace loom
