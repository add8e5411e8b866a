// Reading the tunables.

#include "core/config.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <optional>
#include <string>

#include "core/flight_recorder.h"
#include "core/topology.h"
#include "kernels/reduce.h"
#include "loom/error.h"
#include "util/env.h"

namespace loom {

namespace {

// A count from 1 written in decimal digits alone (no sign, space or suffix), or nullopt.
std::optional<uint64_t> countFrom1(const std::string& text) {
  uint64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || text[0] < '0' || text[0] > '9' || error != std::errc() || stop != end ||
      value == 0) {
    return std::nullopt;
  }
  return value;
}

// N whole numbers from 1 parted by colons ("3:17"), nullopt if `text` is anything else.
template <size_t N>
std::optional<std::array<uint64_t, N>> countsFrom1(const std::string& text) {
  std::array<uint64_t, N> counts{};
  size_t from = 0;
  for (size_t i = 0; i < N; ++i) {
    const size_t colon = i + 1 < N ? text.find(':', from) : text.size();
    if (colon == std::string::npos) return std::nullopt;
    const auto count = countFrom1(text.substr(from, colon - from));
    if (!count) return std::nullopt;
    counts[i] = *count;
    from = colon + 1;
  }
  return counts;
}

}  // namespace

int netLanesRequested() {
  return static_cast<int>(env::integer("LOOM_NET_LANES", 0, 1, Config::kMaxNetLanes));
}

int defaultNetLanes(int coresPerRank) {
  return coresPerRank >= 8 ? 2 : 1;
}

Config Config::load(const Sharing& sharing) {
  Config c;
  c.sharing = sharing;
  const size_t ranks = static_cast<size_t>(std::max(1, sharing.localRanks));
  // Big chunks mean fewer synchronisations per byte; for 4 or more ranks all slots together
  // (2 x P x chunk) stay within 32 MiB, so they live in the last-level cache.
  // Rounded down to whole pages: 16 MiB / 5 (or 6, 7) is not one.
  const size_t defaultChunk =
      std::clamp<size_t>((size_t{16} << 20) / ranks, 1 << 20, 4 << 20) / 4096 * 4096;
  c.chunkBytes = env::bytes("LOOM_CHUNK_BYTES", defaultChunk, 16 << 10, size_t{1} << 30);
  if (c.chunkBytes % 4096 != 0) {
    throw Error(
        ErrorCode::kInvalidArgument, "config", -1,
        "LOOM_CHUNK_BYTES must be a multiple of 4096 (got " + std::to_string(c.chunkBytes) + ")");
  }
  // Collectives cut a slot into one region per rank, each at least a cache line.
  if (c.chunkBytes < 64 * ranks) {
    const size_t least = (64 * ranks + 4095) / 4096 * 4096;
    throw Error(ErrorCode::kInvalidArgument, "config", -1,
                "LOOM_CHUNK_BYTES is " + std::to_string(c.chunkBytes) + ", too small for " +
                    std::to_string(ranks) +
                    " ranks on one host (each needs a 64-byte part of "
                    "a slot); set it to at least " +
                    std::to_string(least) + ", or unset it");
  }
  c.cuda.chunkBytes =
      env::bytes("LOOM_CUDA_CHUNK_BYTES", c.cuda.chunkBytes, 64 << 10, size_t{1} << 30);
  if (c.cuda.chunkBytes % 4096 != 0) {
    throw Error(ErrorCode::kInvalidArgument, "config", -1,
                "LOOM_CUDA_CHUNK_BYTES must be a multiple of 4096 (got " +
                    std::to_string(c.cuda.chunkBytes) + ")");
  }
  if (env::text("LOOM_CUDA_ONE_SHOT_BYTES")) {
    c.cuda.oneShotBytes = env::bytes("LOOM_CUDA_ONE_SHOT_BYTES", 0, 0, SIZE_MAX);
  }
  if (env::text("LOOM_CUDA_PIPELINE")) {
    c.cuda.pipelined = env::integer("LOOM_CUDA_PIPELINE", 0, 0, 1) == 1;
  }
  if (env::text("LOOM_CUDA_FUSED")) {
    c.cuda.fused = env::integer("LOOM_CUDA_FUSED", 0, 0, 1) == 1;
  }
  c.cuda.fusedSharedGpuBytes =
      env::bytes("LOOM_CUDA_FUSED_SHARED_GPU_BYTES", c.cuda.fusedSharedGpuBytes, 0, SIZE_MAX);
  c.cuda.fusedTwoShotBytes =
      env::bytes("LOOM_CUDA_FUSED_TWO_SHOT_BYTES", c.cuda.fusedTwoShotBytes, 0, SIZE_MAX);
  c.cuda.fusedTwoShotBroadcastBytes = env::bytes("LOOM_CUDA_FUSED_TWO_SHOT_BROADCAST_BYTES",
                                                 c.cuda.fusedTwoShotBroadcastBytes, 0, SIZE_MAX);
  c.cuda.fusedChainBroadcastBytes = env::bytes("LOOM_CUDA_FUSED_CHAIN_BROADCAST_BYTES",
                                               c.cuda.fusedChainBroadcastBytes, 0, SIZE_MAX);
  c.cuda.fusedRingAllReduceBytes = env::bytes("LOOM_CUDA_FUSED_RING_ALL_REDUCE_BYTES",
                                              c.cuda.fusedRingAllReduceBytes, 0, SIZE_MAX);
  if (const auto trace = env::text("LOOM_CUDA_FUSED_TRACE")) c.cuda.fusedTrace = *trace;
  c.cuda.fusedBlocks = static_cast<int>(
      env::integer("LOOM_CUDA_FUSED_BLOCKS", c.cuda.fusedBlocks, 1, c.cuda.fusedBlocks));
  // Outputs of 8 MiB and more per rank are written with streaming stores: measured on a
  // 300 MiB-L3 host at 4 and 16 ranks, they win from about there (docs/PERFORMANCE.md).
  c.tuning.streamBytes = env::bytes("LOOM_STREAM_BYTES", size_t{8} << 20, 0, SIZE_MAX);
  // Reading lent inputs in place costs two phases more than staging a chunk; from 1 MiB the
  // copy it saves is worth more (docs/PERFORMANCE.md, "Lent buffers").
  c.tuning.lendBytes = env::bytes("LOOM_LEND_BYTES", size_t{1} << 20, 0, SIZE_MAX);
  // An all_to_all that copies out of peers' memory pays a system call per block and pins
  // every page it reads. Through c10d on 8 and 16 ranks it ran 1.06-1.75x faster than
  // staging from 256 KiB to 16 MiB (0.94x at one point); on 4 ranks 0.83-1.37x below 8 MiB and
  // 1.23-1.63x at 8 and 16 MiB; at 64 MiB, staging with streaming stores ran 5-22% faster
  // (docs/PERFORMANCE.md, "Peer reads"). LOOM_PEER_READS=0 stages everything.
  const size_t peerReadsFrom = ranks >= 8 ? size_t{256} << 10 : size_t{8} << 20;
  // Both read whatever the switch says: a malformed size is an error even while it is off.
  const size_t peerReadBytes = env::bytes("LOOM_PEER_READ_BYTES", peerReadsFrom, 0, SIZE_MAX);
  c.tuning.peerReadBytes = env::integer("LOOM_PEER_READS", 1, 0, 1) == 0 ? SIZE_MAX : peerReadBytes;
  c.tuning.peerReadMaxBytes = env::bytes("LOOM_PEER_READ_MAX_BYTES", size_t{32} << 20, 0, SIZE_MAX);
  c.ringBytes = env::bytes("LOOM_P2P_RING_BYTES", c.ringBytes, 4096, size_t{1} << 30);
  if ((c.ringBytes & (c.ringBytes - 1)) != 0) {
    throw Error(
        ErrorCode::kInvalidArgument, "config", -1,
        "LOOM_P2P_RING_BYTES must be a power of two (got " + std::to_string(c.ringBytes) + ")");
  }
  // By default each rank takes its share of this process's cores, up to 8 helpers. Ranks
  // in other network namespaces of this kernel share the cores too; and across hosts each
  // rank's send and rail threads move network traffic while its helpers run the local steps
  // (the kernel's TCP work counts on those threads): with helpers taking those cores as
  // well, the network threads waited for cores (a 16 MiB all_reduce on 2 namespace hosts x
  // 4 ranks 1.3x slower; docs/PERFORMANCE.md, "Sending from the caller's memory, and
  // helpers across hosts").
  c.netLanes = std::clamp(sharing.netLanes, 1, kMaxNetLanes);
  const int networkThreads = 2 * c.netLanes;  // a send and a rail thread per lane
  const int perRank = availableCores() / std::max(1, sharing.machineRanks);
  const int share = std::max(1, perRank - (sharing.spansHosts ? networkThreads : 0));
  c.tuning.threads = static_cast<int>(env::integer("LOOM_THREADS", std::min(share, 8), 1, 256));
  c.bindRanks = env::integer("LOOM_BIND", 0, 0, 1) == 1;
  // A waiter spins only where every rank on its CPUs can have a core: with more ranks than
  // cores, a spinning waiter holds the core that a peer it waits for needs in order to
  // arrive. 3 ranks on 2 cores: all_reduce, all_gather and broadcast from 8 B to 1 MiB took
  // 0.57-0.72x the time without the spin; 2 ranks on 2 cores were alike either way
  // (docs/PERFORMANCE.md, "Waits on oversubscribed cores").
  const bool oversubscribed = sharing.coreSharers > availableCores();
  c.backoff.spin = std::chrono::microseconds(
      env::integer("LOOM_SPIN_US", oversubscribed ? 0 : 20, 0, 1'000'000));
  c.backoff.yield = std::chrono::microseconds(env::integer("LOOM_YIELD_US", 200, 0, 1'000'000));
  c.netSilence =
      std::chrono::milliseconds(env::integer("LOOM_NET_SILENCE_MS", 10'000, 200, 3'600'000));
  c.tuning.selection = SelectionTable::fromEnvironment(static_cast<int>(ranks));
  if (const auto kill = env::text("LOOM_FAULT_KILL_AT")) {
    const auto at = countsFrom1<2>(*kill);
    if (!at) {
      throw Error(ErrorCode::kInvalidArgument, "config", -1,
                  "LOOM_FAULT_KILL_AT=" + *kill +
                      " must be <collective number>:<phase>, both from 1 (e.g. 3:1); unset it "
                      "outside failure drills");
    }
    c.killAt = {(*at)[0], (*at)[1]};
  }
  if (const auto stall = env::text("LOOM_FAULT_STALL_AT")) {
    const auto at = countsFrom1<3>(*stall);
    if (!at) {
      throw Error(ErrorCode::kInvalidArgument, "config", -1,
                  "LOOM_FAULT_STALL_AT=" + *stall +
                      " must be <collective number>:<phase>:<milliseconds>, each from 1 (e.g. "
                      "2:1:3000); unset it outside failure drills");
    }
    c.stallAt = {(*at)[0], (*at)[1], std::chrono::milliseconds((*at)[2])};
  }
  // Bad values of these fail here, at creation, not in the first call (where ranks with a
  // good value would wait in it for the ones that failed).
  kernels::activeIsa();
  detail::FlightRecorder::instance();
  return c;
}

}  // namespace loom
