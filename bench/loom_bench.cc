// loom-bench: times loom's collectives between forked ranks, in the style of nccl-tests
// (time, algbw, busbw and #wrong per size, out of place and in place), beside the memory
// copy bandwidth measured in the same run with the same threads, so every large-size figure
// comes with its roofline fraction. Ranks run on this host, on hosts made of network
// namespaces on this machine (--hosts, optionally with shaped links), or on several machines
// (--nnodes). Run `loom-bench --help` for the options.

#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "bench_ops.h"
#include "core/config.h"
#include "core/topology.h"
#include "kernels/reduce.h"
#include "loom/loom.h"
#include "netns_hosts.h"
#include "thread_census.h"
#include "transport/shm/peer_reads.h"
#include "util/env.h"
#include "util/helper_pool.h"
#include "util/trace.h"

namespace loom::bench {
namespace {

using Clock = std::chrono::steady_clock;
using testing::GroupDelta;
using testing::groupDeltas;
using testing::groupName;
using testing::machineTimes;
using testing::MachineTimes;
using testing::snapshotThreads;
using testing::ThreadGroup;
using testing::ThreadSnapshot;

struct Options {
  int ranks = 2;
  size_t minBytes = 8;
  size_t maxBytes = size_t{256} << 20;
  double factor = 2;
  std::vector<BenchOp> ops{BenchOp::kAllReduce, BenchOp::kAllGather, BenchOp::kReduceScatter,
                           BenchOp::kBroadcast, BenchOp::kAllToAll};
  DataType type = DataType::kFloat32;
  ReduceOp reduce = ReduceKind::kSum;
  int warmup = 5;
  int reps = 5;
  double repMs = 20;
  bool check = true;
  bool copyBandwidth = true;
  bool lent = false;
  bool pin = false;
  bool census = false;
  bool afterBarrier = false;  // each timed call alone after a barrier, rank 0's times
  std::string json;
  // Across hosts: namespace hosts on this machine, or this node of a job over machines.
  int hosts = 1;
  double linkGbit = 0;
  int nnodes = 1;
  int nodeRank = 0;
  std::string masterHost;
  uint16_t masterPort = 0;

  int world() const { return ranks * nnodes; }
  int hostCount() const { return std::max(hosts, nnodes); }
};

const char* kUsage =
    R"(loom-bench: collective bandwidth and latency between forked ranks.

  -n, --ranks N        ranks to fork (default 2; with --nnodes, per node)
  -b, --min-bytes S    smallest size, e.g. 8, 64K, 1M (default 8)
  -e, --max-bytes S    largest size (default 256M)
  -f, --factor F       size multiplier between rows (default 2)
  -o, --ops LIST       comma-separated: all_reduce, all_gather, reduce_scatter, broadcast,
                       all_to_all, reduce, gather, scatter (default: the first five)
  -d, --dtype T        float32 float64 float16 bfloat16 int8 uint8 int16 int32 int64 (default float32)
  -r, --reduce R       sum prod min max avg (default sum)
  -w, --warmup N       warm-up runs per size (default 5)
  -R, --reps N         timed repetitions per size; the median is reported (default 5)
  -T, --rep-ms MS      target length of one repetition in ms (default 20)
  -c, --check 0|1      count wrong elements against the reference (default 1)
      --no-copy-bw     skip the copy-bandwidth baseline
      --pin            pin each forked rank to its own share of the cores, as Intel MPI
                       pins ranks (its helpers stay at that share: LOOM_THREADS)
      --census         after each row, what the threads did during its timed calls (summed
                       over ranks): calls over 5x their rank's median and the slowest, the
                       calling thread's forced switches and time waiting for a core, each
                       loom thread group's wake-ups and CPU time, and the cores other
                       processes on the machine used meanwhile (times each call)
      --lent           buffers from the lending pool (as torch's allocate_tensor gives):
                       all_gather and reduce_scatter from LOOM_LEND_BYTES read them in place
      --after-barrier  time every call alone, right after a barrier, as rank 0 sees it (as
                       python -m loom.bench times calls through torch): time and p90 are
                       rank 0's median and 90th percentile single call, the latency of one
                       call with the barrier's exit skew, not a mean of back-to-back calls
  -J, --json FILE      also write one JSON object per row to FILE
  -h, --help           this text

Across hosts:
      --hosts H        place the ranks on H hosts made of network namespaces on this
                       machine, host by host (needs root and iproute2); the network between
                       them is libfabric over veth pairs and a bridge
      --link-gbit G    with --hosts: limit every host's link to G Gb/s each way (tc tbf)
      --nnodes N --node-rank K --master HOST:PORT
                       this machine is node K of N: it forks ranks K*n .. K*n+n-1; node 0
                       serves the rendezvous store on PORT of HOST, which all nodes reach

Sizes follow nccl-tests: the whole buffer (all_reduce, broadcast, reduce), the whole output
(all_gather, gather), the whole input (reduce_scatter, scatter), the per-rank buffer
(all_to_all). time is the median over repetitions of the slowest rank's mean per call;
p90 the 90th percentile of single calls' times on the rank where it is highest (a call
can overlap the next one on other ranks, so p90 can sit below time);
algbw = size / time; busbw = algbw x 2(P-1)/P (all_reduce), (P-1)/P (all_gather,
reduce_scatter, all_to_all), 1 (rooted). roofline = bytes loom's algorithm moves through
memory / time / the copy bandwidth measured at the start with the same ranks and threads;
dram = the same with the bytes each rank must read and write once (its input and its
output), what an algorithm that copies nothing else could reach. With --lent the
roofline is "-": lent buffers take paths its model does not describe.
Across H hosts, hostbw = algbw x the same factor with P = H: the rate at which each host's
link carries its share (compare it with the link's speed).
Environment: LOOM_THREADS, LOOM_CHUNK_BYTES, LOOM_ALGO, LOOM_ISA tune loom itself.
)";

[[noreturn]] void usageError(const std::string& what) {
  std::cerr << "loom-bench: " << what << "\n\n" << kUsage;
  std::exit(2);
}

size_t parseSize(const std::string& s) {
  const auto v = env::parseBytes(s);
  if (!v) usageError("'" + s + "' is not a size");
  return static_cast<size_t>(*v);
}

Options parse(int argc, char** argv) {
  Options o;
  std::vector<std::string> args(argv + 1, argv + argc);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size()) usageError(a + " needs a value");
      return args[++i];
    };
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      std::exit(0);
    } else if (a == "-n" || a == "--ranks") {
      o.ranks = std::atoi(value().c_str());
    } else if (a == "-b" || a == "--min-bytes") {
      o.minBytes = parseSize(value());
    } else if (a == "-e" || a == "--max-bytes") {
      o.maxBytes = parseSize(value());
    } else if (a == "-f" || a == "--factor") {
      o.factor = std::atof(value().c_str());
    } else if (a == "-o" || a == "--ops") {
      o.ops.clear();
      std::string list = value();
      size_t start = 0;
      while (start <= list.size()) {
        const size_t end = std::min(list.find(',', start), list.size());
        const std::string name = list.substr(start, end - start);
        const auto op = parseOp(name);
        if (!op) usageError("unknown op '" + name + "'");
        o.ops.push_back(*op);
        start = end + 1;
      }
    } else if (a == "-d" || a == "--dtype") {
      const std::string name = value();
      bool found = false;
      for (int t = 0; t < kNumDataTypes && !found; ++t) {
        if (dataTypeName(static_cast<DataType>(t)) == name) {
          o.type = static_cast<DataType>(t);
          found = true;
        }
      }
      if (!found || o.type == DataType::kBool) usageError("unknown dtype '" + name + "'");
    } else if (a == "-r" || a == "--reduce") {
      const std::string name = value();
      if (name == "sum")
        o.reduce = ReduceKind::kSum;
      else if (name == "prod")
        o.reduce = ReduceKind::kProduct;
      else if (name == "min")
        o.reduce = ReduceKind::kMin;
      else if (name == "max")
        o.reduce = ReduceKind::kMax;
      else if (name == "avg")
        o.reduce = ReduceKind::kAvg;
      else
        usageError("unknown reduction '" + name + "'");
    } else if (a == "-w" || a == "--warmup") {
      o.warmup = std::atoi(value().c_str());
    } else if (a == "-R" || a == "--reps") {
      o.reps = std::atoi(value().c_str());
    } else if (a == "-T" || a == "--rep-ms") {
      o.repMs = std::atof(value().c_str());
    } else if (a == "-c" || a == "--check") {
      o.check = std::atoi(value().c_str()) != 0;
    } else if (a == "--no-copy-bw") {
      o.copyBandwidth = false;
    } else if (a == "--pin") {
      o.pin = true;
    } else if (a == "--census") {
      o.census = true;
    } else if (a == "--lent") {
      o.lent = true;
    } else if (a == "--after-barrier") {
      o.afterBarrier = true;
    } else if (a == "-J" || a == "--json") {
      o.json = value();
    } else if (a == "--hosts") {
      o.hosts = std::atoi(value().c_str());
    } else if (a == "--link-gbit") {
      o.linkGbit = std::atof(value().c_str());
    } else if (a == "--nnodes") {
      o.nnodes = std::atoi(value().c_str());
    } else if (a == "--node-rank") {
      o.nodeRank = std::atoi(value().c_str());
    } else if (a == "--master") {
      const std::string master = value();
      const size_t colon = master.rfind(':');
      if (colon == std::string::npos) usageError("--master needs HOST:PORT");
      o.masterHost = master.substr(0, colon);
      o.masterPort = static_cast<uint16_t>(std::atoi(master.c_str() + colon + 1));
    } else {
      usageError("unknown option '" + a + "'");
    }
  }
  if (o.ranks < 1 || o.ranks > 1024) usageError("--ranks must be in [1, 1024]");
  if (o.minBytes < 1 || o.maxBytes < o.minBytes) usageError("need 1 <= min-bytes <= max-bytes");
  if (o.factor <= 1) usageError("--factor must exceed 1");
  if (o.reps < 1 || o.warmup < 0 || o.repMs <= 0) usageError("bad warmup, reps or rep-ms");
  if (!isSupported(o.reduce.kind(), o.type))
    usageError("that reduction does not apply to that dtype");
  if (o.hosts < 1 || o.ranks % o.hosts != 0) usageError("--hosts must divide --ranks");
  if (o.linkGbit < 0 || (o.linkGbit > 0 && o.hosts == 1)) usageError("--link-gbit needs --hosts");
  if (o.nnodes < 1 || o.nodeRank < 0 || o.nodeRank >= o.nnodes)
    usageError("bad --nnodes/--node-rank");
  if (o.nnodes > 1 && (o.masterHost.empty() || o.masterPort == 0))
    usageError("--nnodes needs --master");
  if (o.nnodes > 1 && o.hosts > 1) usageError("--hosts and --nnodes do not mix");
  return o;
}

// The bench's own calls (barriers, agreeing on numbers) are blocking, so they run on the
// calling thread as the timed calls do: queued ones would wake the communicator's worker,
// whose wait for a next job then competes with the timed calls for the cores.
OpOptions blocking() {
  OpOptions o;
  o.blocking = true;
  return o;
}

double maxOverRanks(Communicator& comm, double v) {
  double out = 0;
  comm.allReduce(&v, &out, 1, DataType::kFloat64, ReduceKind::kMax, blocking()).wait();
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The nearest-rank 90th percentile (with fewer than 10 values, the largest).
double percentile90(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[(v.size() * 9 + 9) / 10 - 1];
}

// Copy bandwidth (bytes read + written per second, all ranks together) with every rank
// copying `bytes` at once using `threads` threads, as the collectives would.
double copyBandwidth(Communicator& comm, size_t bytes, int threads) {
  std::vector<uint8_t> src(bytes, 1), dst(bytes, 2);
  std::vector<double> samples;
  for (int rep = 0; rep < 6; ++rep) {
    comm.barrier(blocking()).wait();
    const auto t0 = Clock::now();
    HelperPool::instance().run(threads, threads, [&](int part) {
      const size_t begin = bytes * part / threads;
      const size_t end = bytes * (part + 1) / threads;
      std::memcpy(dst.data() + begin, src.data() + begin, end - begin);
    });
    const double seconds =
        maxOverRanks(comm, std::chrono::duration<double>(Clock::now() - t0).count());
    if (rep > 0) samples.push_back(2.0 * bytes * comm.size() / seconds);  // rep 0 warms up
  }
  return median(samples);
}

// What happened during a size's timed calls (--census), summed over ranks unless noted.
struct Census {
  double slowCalls = 0;    // calls over 5x their rank's median call
  double slowestUs = 0;    // the slowest call on any rank
  double wallSeconds = 0;  // rank 0's time for all the timed calls
  double loomCpuUs = 0;    // CPU time of every thread of every rank
  GroupDelta groups[static_cast<int>(ThreadGroup::kCount)];
  MachineTimes machine;  // rank 0's view of the whole machine, for the same interval
};

struct Timing {
  double us = 0;
  double p90Us = 0;  // the 90th percentile of single calls, on the rank where it is highest
  size_t wrong = 0;
  Census census;
};

// Sums (or, for the slowest call, takes the maximum of) each rank's census over ranks.
void reduceCensus(Communicator& comm, Census& c) {
  std::vector<double> v{c.slowCalls, c.loomCpuUs};
  for (const GroupDelta& g : c.groups) {
    v.insert(v.end(), {g.runUs, g.waitUs, g.slices, g.involuntary});
  }
  std::vector<double> sum(v.size());
  comm.allReduce(v.data(), sum.data(), v.size(), DataType::kFloat64, ReduceKind::kSum, blocking())
      .wait();
  c.slowCalls = sum[0];
  c.loomCpuUs = sum[1];
  for (size_t g = 0; g < std::size(c.groups); ++g) {
    c.groups[g] = {sum[2 + 4 * g], sum[3 + 4 * g], sum[4 + 4 * g], sum[5 + 4 * g]};
  }
  c.slowestUs = maxOverRanks(comm, c.slowestUs);
}

// One line after a row: where the time went while that row's calls ran.
void printCensus(const char* label, const Census& c, bool oneMachine) {
  const auto& caller = c.groups[static_cast<int>(ThreadGroup::kCaller)];
  std::printf(
      "#   census %s: %.0f slow calls (slowest %.1f us) | caller: %.0f forced off, %.0f us "
      "waiting for a core |",
      label, c.slowCalls, c.slowestUs, caller.involuntary, caller.waitUs);
  for (int g = 1; g < static_cast<int>(ThreadGroup::kCount); ++g) {
    std::printf(" %s %.0f wakes %.0f us |", groupName(static_cast<ThreadGroup>(g)),
                c.groups[g].slices, c.groups[g].runUs);
  }
  if (oneMachine) {
    // /proc/stat counts in ticks (10 ms): meaningful over rows that take 100 ms or more.
    const double others = c.machine.busy - c.loomCpuUs / 1e6;
    std::printf(" others %.2f cores, steal %.2f cores",
                std::max(0.0, others) / std::max(c.wallSeconds, 1e-9),
                c.machine.steal / std::max(c.wallSeconds, 1e-9));
  }
  std::printf("\n");
}

Timing timeCase(Communicator& comm, OpCase& c, const Options& o, uint32_t salt) {
  for (int i = 0; i < o.warmup; ++i) c.launch().wait();
  // With --after-barrier every timed call follows a barrier of its own.
  auto settle = [&] {
    if (o.afterBarrier) comm.barrier(blocking()).wait();
  };
  // Agree on the iterations per repetition from runs of 1, 8, 64, ... calls, until one lasts
  // 2 ms: a single call after a barrier pays the barrier's exit skew too, and estimating from
  // it alone once made a row's repetitions a few calls long, their means mostly that skew.
  double estimate = 0;
  for (int calls = 1;; calls *= 8) {
    comm.barrier(blocking()).wait();
    const auto start = Clock::now();
    for (int i = 0; i < calls; ++i) {
      settle();
      c.launch().wait();
    }
    const double seconds =
        maxOverRanks(comm, std::chrono::duration<double>(Clock::now() - start).count());
    estimate = seconds / calls;
    if (seconds >= 2e-3 || calls >= 4096) break;
  }
  const int iters =
      static_cast<int>(std::clamp(o.repMs / 1000 / std::max(estimate, 1e-9), 1.0, 10000.0));
  std::vector<double> samples;
  std::vector<double> calls;  // every call's time, in microseconds
  calls.reserve(static_cast<size_t>(iters) * o.reps);
  Timing t;
  ThreadSnapshot threadsBefore;
  MachineTimes machineBefore;
  Clock::time_point censusStart;
  if (o.census) {
    threadsBefore = snapshotThreads();
    machineBefore = machineTimes();
    censusStart = Clock::now();
  }
  for (int rep = 0; rep < o.reps; ++rep) {
    comm.barrier(blocking()).wait();
    if (o.afterBarrier) {
      for (int i = 0; i < iters; ++i) {
        settle();
        const auto t0 = Clock::now();
        c.launch().wait();
        calls.push_back(std::chrono::duration<double>(Clock::now() - t0).count() * 1e6);
      }
      continue;
    }
    // One clock read per call (a call ends where the next begins), so timing single calls
    // adds about 20 ns to each.
    const auto t0 = Clock::now();
    auto last = t0;
    for (int i = 0; i < iters; ++i) {
      c.launch().wait();
      const auto now = Clock::now();
      calls.push_back(std::chrono::duration<double>(now - last).count() * 1e6);
      last = now;
    }
    const double mean = std::chrono::duration<double>(last - t0).count() / iters;
    samples.push_back(maxOverRanks(comm, mean));
  }
  if (o.census) {
    Census& census = t.census;
    census.wallSeconds = std::chrono::duration<double>(Clock::now() - censusStart).count();
    const MachineTimes machineAfter = machineTimes();
    census.machine = {machineAfter.busy - machineBefore.busy,
                      machineAfter.steal - machineBefore.steal};
    const auto groups = groupDeltas(threadsBefore, snapshotThreads());
    for (const auto& [group, delta] : groups) {
      census.groups[static_cast<int>(group)] = delta;
      census.loomCpuUs += delta.runUs;
    }
    const double typical = median(calls);
    census.slowestUs = *std::max_element(calls.begin(), calls.end());
    census.slowCalls = static_cast<double>(
        std::count_if(calls.begin(), calls.end(), [&](double us) { return us > 5 * typical; }));
    reduceCensus(comm, census);
  }
  if (o.afterBarrier) {
    // Rank 0's single calls, as python -m loom.bench reports them (only rank 0 prints).
    t.us = median(calls);
    t.p90Us = percentile90(calls);
  } else {
    t.us = median(samples) * 1e6;
    t.p90Us = maxOverRanks(comm, percentile90(calls));
  }
  if (o.check) {
    c.refill(salt);
    c.launch().wait();
    double wrong = static_cast<double>(c.wrong(salt));
    double total = 0;
    comm.allReduce(&wrong, &total, 1, DataType::kFloat64, ReduceKind::kSum, blocking()).wait();
    t.wrong = static_cast<size_t>(total);
  }
  return t;
}

int rankMain(int rank, const Options& o, std::shared_ptr<Store> store) {
  const int world = o.world();
  auto comm = Communicator::create(rank, world, store);
  // What the communicator chose: namespace hosts (--hosts) share this machine's cores.
  const Config config = Config::load(
      Config::Sharing{world / o.hostCount(), o.hosts > 1 ? world : o.ranks, o.hostCount() > 1});
  const bool lead = rank == 0;
  std::ofstream json;
  if (lead && !o.json.empty()) json.open(o.json);
  if (lead) {
    std::printf(
        "# loom-bench: %d ranks on %d host(s) (%s%s), %d cores available, %d thread(s)/rank, "
        "kernels %s, chunk %zu KiB%s%s\n",
        world, o.hostCount(), o.hosts > 1 ? "network namespaces" : localHost().hostname.c_str(),
        o.linkGbit > 0 ? (", links shaped to " + std::to_string(o.linkGbit) + " Gb/s").c_str() : "",
        availableCores(), config.tuning.threads,
        std::string(kernels::isaName(kernels::activeIsa())).c_str(), config.chunkBytes >> 10,
        o.lent ? ", buffers lent" : "",
        o.afterBarrier ? ", each call timed alone after a barrier (rank 0's times)" : "");
  }
  double copyBw = 0;
  if (o.copyBandwidth) {
    const size_t bytes = std::clamp(o.maxBytes, size_t{64} << 20, size_t{256} << 20);
    copyBw = copyBandwidth(*comm, bytes, config.tuning.threads);
    if (lead) {
      std::printf(
          "# copy bandwidth: %.1f GB/s (read + write, %d ranks x %d threads each copying "
          "%zu MiB at once)\n",
          copyBw / 1e9, world, config.tuning.threads, bytes >> 20);
    }
  }
  size_t totalWrong = 0;
  double busSum = 0;
  int busRows = 0;
  uint32_t salt = 1;
  for (BenchOp op : o.ops) {
    if (lead) {
      std::printf("#\n# %s  %s  %s\n", std::string(opName(op)).c_str(),
                  std::string(dataTypeName(o.type)).c_str(),
                  std::string(reduceKindName(o.reduce.kind())).c_str());
      std::printf("# %12s %12s  %10s %9s %8s %8s %6s  %10s %9s %8s %8s %6s  %8s %7s%s\n", "size(B)",
                  "count", "oop(us)", "p90", "algbw", "busbw", "#wrong", "ip(us)", "p90", "algbw",
                  "busbw", "#wrong", "roofline", "dram", o.hostCount() > 1 ? "    hostbw" : "");
    }
    for (double s = static_cast<double>(o.minBytes); s <= static_cast<double>(o.maxBytes) * 1.0001;
         s *= o.factor) {
      Timing t[2];
      size_t bytes = 0, count = 0;
      uint64_t peerReads = 0;  // out-of-place collectives that read peers' memory (rank 0)
      for (int inPlace = 0; inPlace < 2; ++inPlace) {
        OpCase c(*comm, op, o.type, o.reduce, static_cast<size_t>(s), inPlace == 1, o.lent);
        bytes = c.bytes();
        count = c.count();
        const uint64_t readsBefore = shm::peerReadCollectives();
        t[inPlace] = timeCase(*comm, c, o, salt++);
        if (inPlace == 0) peerReads = shm::peerReadCollectives() - readsBefore;
      }
      totalWrong += t[0].wrong + t[1].wrong;
      if (!lead) continue;
      const double algbw[2] = {bytes / t[0].us / 1e3, bytes / t[1].us / 1e3};
      const double bus = busFactor(op, world);
      // The roofline models one host's shared memory; across hosts the network rules. An
      // all_to_all that read peers' memory copied nothing else: its traffic is the DRAM
      // model's. Lent buffers take paths the model does not describe: no roofline then.
      const bool modelled = o.hostCount() == 1 && !o.lent;
      const double k = !modelled ? 0
                       : op == BenchOp::kAllToAll && peerReads > 0
                           ? dramFactor(op, world)
                           : trafficFactor(op, world, bytes, config.tuning.selection);
      const double roof = copyBw > 0 ? k * bytes / (t[0].us * 1e-6) / copyBw * 100 : 0;
      const double dramK = o.hostCount() > 1 ? 0 : dramFactor(op, world);
      const double dram = copyBw > 0 ? dramK * bytes / (t[0].us * 1e-6) / copyBw * 100 : 0;
      const double hostbw = algbw[0] * busFactor(op, o.hostCount());
      busSum += algbw[0] * bus;
      ++busRows;
      std::printf("  %12zu %12zu  %10.2f %9.2f %8.2f %8.2f %6zu  %10.2f %9.2f %8.2f %8.2f %6zu  ",
                  bytes, count, t[0].us, t[0].p90Us, algbw[0], algbw[0] * bus, t[0].wrong, t[1].us,
                  t[1].p90Us, algbw[1], algbw[1] * bus, t[1].wrong);
      if (modelled || o.hostCount() > 1) {
        std::printf("%7.1f%% ", roof);
      } else {
        std::printf("%8s ", "-");
      }
      std::printf("%6.1f%%", dram);
      if (o.hostCount() > 1) std::printf(" %9.3f", hostbw);
      std::printf("\n");
      if (o.census) {
        printCensus("oop", t[0].census, o.nnodes == 1);
        printCensus("ip ", t[1].census, o.nnodes == 1);
      }
      std::fflush(stdout);
      if (json.is_open()) {
        for (int ip = 0; ip < 2; ++ip) {
          json << "{\"op\":\"" << opName(op) << "\",\"ranks\":" << world
               << ",\"hosts\":" << o.hostCount() << ",\"link_gbit\":" << o.linkGbit
               << ",\"threads\":" << config.tuning.threads << ",\"dtype\":\""
               << dataTypeName(o.type) << "\",\"bytes\":" << bytes
               << ",\"inplace\":" << (ip ? "true" : "false") << ",\"time_us\":" << t[ip].us
               << ",\"p90_us\":" << t[ip].p90Us << ",\"algbw\":" << algbw[ip]
               << ",\"busbw\":" << algbw[ip] * bus << ",\"wrong\":" << t[ip].wrong
               << ",\"copy_bw\":" << copyBw / 1e9 << ",\"roofline\":"
               << (modelled || o.hostCount() > 1 ? std::to_string(ip ? 0.0 : roof / 100) : "null")
               << ",\"dram\":" << (ip ? 0.0 : dram / 100)
               << ",\"lent\":" << (o.lent ? "true" : "false")
               << ",\"hostbw\":" << algbw[ip] * busFactor(op, o.hostCount()) << "}\n";
        }
      }
    }
  }
  if (lead) {
    std::printf("#\n# out-of-place bus bandwidth, mean over rows: %.2f GB/s\n# #wrong total: %zu\n",
                busRows ? busSum / busRows : 0.0, totalWrong);
    // Whether all_to_alls copied out of peers' memory (LOOM_PEER_READS and its range; the
    // kernel may refuse it, docs/SECURITY.md).
    std::printf("# collectives that read peers' memory (rank 0): %llu\n",
                static_cast<unsigned long long>(shm::peerReadCollectives()));
  }
  comm->barrier(blocking()).wait();
  return totalWrong == 0 ? 0 : 1;
}

// Pins this process to the local-th of `ranks` equal shares of the cores it may run on,
// keeping as many helper threads as the unpinned rank would have (LOOM_THREADS, unless set).
void pinToShare(int local, int ranks) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  const int n = static_cast<int>(cpus.size());
  const int share = std::max(1, n / ranks);
  cpu_set_t mine;
  CPU_ZERO(&mine);
  for (int i = 0; i < share; ++i) CPU_SET(cpus[(local * share + i) % n], &mine);
  ::setenv("LOOM_THREADS", std::to_string(std::min(share, 8)).c_str(), 0);
  if (::sched_setaffinity(0, sizeof mine, &mine) != 0) std::perror("loom-bench --pin");
}

}  // namespace

}  // namespace loom::bench

int main(int argc, char** argv) {
  using namespace loom;
  const bench::Options options = bench::parse(argc, argv);
  // Where the store is served: this machine's loopback, or node 0 of several machines.
  const bool serves = options.nodeRank == 0;
  const std::string storeHost = options.nnodes > 1 ? options.masterHost : "127.0.0.1";
  std::unique_ptr<TcpStoreServer> server;
  if (serves) server = std::make_unique<TcpStoreServer>(storeHost, options.masterPort);
  const uint16_t port = serves ? server->port() : options.masterPort;
  std::unique_ptr<testing::NetnsHosts> hosts;
  if (options.hosts > 1) {
    const std::string why = testing::NetnsHosts::unavailableReason();
    if (!why.empty()) {
      std::fprintf(stderr, "loom-bench: --hosts: %s\n", why.c_str());
      return 2;
    }
    hosts = std::make_unique<testing::NetnsHosts>(options.hosts);
    for (int h = 0; h < options.hosts && options.linkGbit > 0; ++h)
      hosts->shape(h, options.linkGbit);
    ::setenv("LOOM_NET_IFNAME", "eth0", 1);  // the namespace hosts' one interface
  }
  std::vector<pid_t> children;
  std::fflush(stdout);
  const int perHost = options.ranks / options.hosts;
  for (int local = 0; local < options.ranks; ++local) {
    const int r = options.nodeRank * options.ranks + local;
    const pid_t pid = ::fork();
    if (pid == 0) {
      if (server) server->closeInChild();
      int code = 1;
      try {
        // The store connection is made first: from inside a namespace host, this machine's
        // loopback (where the store listens) is out of reach.
        auto store = std::make_shared<TcpStore>(storeHost, port);
        if (hosts) hosts->enter(local / perHost);
        if (options.pin) bench::pinToShare(local, options.ranks);
        code = bench::rankMain(r, options, store);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "loom-bench rank %d: %s\n", r, e.what());
      }
      std::fflush(stdout);
      trace::flush();  // _exit skips the atexit handler that would write it
      ::_exit(code);
    }
    children.push_back(pid);
  }
  if (server) server->start();
  int worst = 0;
  for (pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    worst = std::max(worst, code);
  }
  return worst;
}
