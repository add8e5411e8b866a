#pragma once

// Tunables, read from LOOM_* environment variables when a communicator is made. The
// variables and their defaults are listed in docs/CONFIGURATION.md.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <optional>
#include <string>

#include "algorithms/collective.h"
#include "util/backoff.h"

namespace loom {

/// How CUDA collectives move their bytes (see core/cuda_executor.h).
struct CudaTuning {
  /// Bytes each rank moves per step through its device workspace (LOOM_CUDA_CHUNK_BYTES);
  /// the workspace holds twelve of them.
  size_t chunkBytes = 8 << 20;
  /// all_reduce: the largest size reduced one-shot (LOOM_CUDA_ONE_SHOT_BYTES); unset:
  /// 256 KiB, or every size when the ranks share one GPU or are two.
  std::optional<size_t> oneShotBytes;
  /// Whether a call of several steps runs alternate steps on two streams
  /// (LOOM_CUDA_PIPELINE); unset: unless every rank is on one GPU and not all of them are
  /// MPS clients (cuda_paths.h).
  std::optional<bool> pipelined;
  /// Whether an eager all_reduce that every rank reduces whole runs as one fused kernel
  /// (LOOM_CUDA_FUSED); unset: when every rank has a GPU of its own, or every rank that
  /// shares one is an MPS client (then up to fusedSharedGpuBytes).
  std::optional<bool> fused;
  /// Where the fused path is on by default for ranks that share a GPU under MPS: the largest
  /// collective (a rank's largest buffer of the call) it runs (LOOM_CUDA_FUSED_SHARED_GPU_BYTES).
  size_t fusedSharedGpuBytes = 512 << 10;
  /// The most block pairs a fused kernel runs, 1-64 (LOOM_CUDA_FUSED_BLOCKS).
  int fusedBlocks = 64;
  /// The smallest all_reduce (above oneShotBytes) that a fused kernel runs in two shots, for
  /// more than two ranks (LOOM_CUDA_FUSED_TWO_SHOT_BYTES); smaller ones take stepped steps.
  size_t fusedTwoShotBytes = size_t{2} << 20;
  /// The smallest broadcast that a fused kernel runs in two shots, for more than two ranks
  /// (LOOM_CUDA_FUSED_TWO_SHOT_BROADCAST_BYTES); smaller ones, the one-shot fused kernel.
  size_t fusedTwoShotBroadcastBytes = size_t{2} << 20;
  /// The smallest broadcast that a fused kernel runs along a chain, for more than two ranks
  /// (LOOM_CUDA_FUSED_CHAIN_BROADCAST_BYTES); smaller ones, two shots or one.
  size_t fusedChainBroadcastBytes = size_t{32} << 20;
  /// The smallest all_reduce that a fused kernel runs around a ring, for more than two ranks
  /// and element types that accumulate in themselves (LOOM_CUDA_FUSED_RING_ALL_REDUCE_BYTES);
  /// smaller ones, and float16/bfloat16 (which accumulate in float32), run in two shots.
  size_t fusedRingAllReduceBytes = size_t{16} << 20;
  /// Debug: a path prefix for the fused kernels' step timeline (LOOM_CUDA_FUSED_TRACE;
  /// CudaFusedTrace); empty: none.
  std::string fusedTrace;
};

struct Config {
  /// Bytes per slot half (LOOM_CHUNK_BYTES). The leader's value is used by all ranks.
  size_t chunkBytes = 1 << 20;
  /// CUDA collectives (LOOM_CUDA_*); all ranks must agree.
  CudaTuning cuda;
  /// Bytes per point-to-point ring, a power of two (LOOM_P2P_RING_BYTES).
  size_t ringBytes = 256 << 10;
  /// Spin and yield before sleeping (LOOM_SPIN_US, LOOM_YIELD_US); no spin by default where
  /// more ranks than cores share this rank's CPUs (Sharing::coreSharers).
  BackoffPolicy backoff;
  /// Threads, streaming threshold and algorithm table (LOOM_THREADS, LOOM_STREAM_BYTES,
  /// LOOM_ALGO).
  Tuning tuning;
  /// Whether the first communicator of a process keeps each rank of the host to CPUs of its
  /// own (LOOM_BIND=1; core/placement.h says when it does, and why it is off by default).
  bool bindRanks = false;
  /// Lanes of collectives across hosts (LOOM_NET_LANES): each a connection to every peer
  /// with a send and a rail thread of its own (algorithms/network_context.h); the same on
  /// every rank (agreed when the ranks meet, Sharing::netLanes).
  int netLanes = 1;
  static constexpr int kMaxNetLanes = 4;
  /// How long a rank of another host may stay silent before the communicator fails
  /// (LOOM_NET_SILENCE_MS); heartbeats go out at a tenth of it.
  std::chrono::milliseconds netSilence{10'000};
  /// Fault injection for tests and failure drills (LOOM_FAULT_KILL_AT="<seq>:<phase>"):
  /// this process kills itself with SIGKILL right after posting the phase-th phase of its
  /// collective number seq on a communicator. {0, 0}: off.
  struct KillPoint {
    uint64_t seq = 0;
    uint64_t phase = 0;
  } killAt;
  /// The same for a pause (LOOM_FAULT_STALL_AT="<seq>:<phase>:<ms>"): this process sleeps
  /// that long right after posting that phase, as a rank the scheduler leaves out would.
  struct StallPoint {
    uint64_t seq = 0;
    uint64_t phase = 0;
    std::chrono::milliseconds pause{0};
  } stallAt;

  /// Who a rank shares its host and its cores with, for the defaults that share them out.
  struct Sharing {
    int localRanks = 1;       ///< ranks of this host (shared memory): chunk sizes, algorithms
    int machineRanks = 1;     ///< ranks on this machine's cores, other network namespaces included
    bool spansHosts = false;  ///< every rank also runs threads that move network traffic
    int netLanes = 1;         ///< the lanes of that traffic, two threads each
    /// Ranks on this machine that may run on exactly this rank's CPUs, this one included.
    int coreSharers = 1;
    /// A child communicator's (split, new_group), with `childLocalRanks` members on this
    /// rank's host and members on other hosts or not: the machine's ranks stay this
    /// communicator's, since the processes outside the child still run on the same cores.
    Sharing child(int childLocalRanks, bool childSpansHosts) const {
      return {childLocalRanks, std::max(machineRanks, childLocalRanks), childSpansHosts, netLanes,
              coreSharers};
    }
  };
  /// What the defaults were shared out by (load's argument).
  Sharing sharing;
  /// Reads the environment for a rank of one host whose `localRanks` ranks share its cores.
  static Config load(int localRanks) {
    return load(Sharing{localRanks, localRanks, false, 1, localRanks});
  }
  /// Reads the environment for a rank that shares as `sharing` says.
  static Config load(const Sharing& sharing);
};

/// LOOM_NET_LANES as this rank asks for it: 1 to Config::kMaxNetLanes, or 0 where it is
/// unset. The ranks of a communicator exchange it when they meet (bootstrap.h), since they
/// must all use the same number of lanes.
int netLanesRequested();
/// The lanes where no rank asked for a number: two where the rank with the fewest cores to
/// itself has `coresPerRank` of at least 8 (room for a second lane's send and rail threads
/// beside the first's, the collective's thread and some helpers), else one.
int defaultNetLanes(int coresPerRank);

}  // namespace loom
