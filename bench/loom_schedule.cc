// loom-schedule: the schedules of loom's collectives across hosts, simulated instead of run
// (algorithms/schedule.h): for each number of hosts and size, every rank's steps are
// recorded from the real algorithms, played against each other (a deadlock or a mismatched
// message is an error), and timed with a cost model. docs/SCALING.md is made from its
// output. Run `loom-schedule --help` for the options.

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "algorithms/schedule.h"
#include "bench_ops.h"
#include "util/env.h"

namespace loom::bench {
namespace {

struct Options {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  std::vector<int> hosts{2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048};
  int perHost = 8;
  std::vector<size_t> bytes{8, 64 << 10, 1 << 20, 25 << 20, 256 << 20};
  CostModel cost;
  // DDP projection: gradient bytes, bucket bytes, compute time and the part of it that
  // communication can hide behind (the backward pass).
  size_t ddpBytes = 0;
  size_t bucketBytes = 25 << 20;
  double computeMs = 0;
  double overlap = 2.0 / 3.0;
};

const char* kUsage = R"(loom-schedule: simulated schedules of loom's collectives across hosts.

  -o, --op NAME            all_reduce, all_gather, reduce_scatter, broadcast, all_to_all,
                           reduce, gather, scatter (default all_reduce)
  -H, --hosts LIST         host counts, e.g. 2,4,8 (default 2,4,...,2048)
  -p, --ranks-per-host N   ranks on every host (default 8)
  -b, --bytes LIST         sizes as loom-bench counts them, e.g. 8,64K,25M (default
                           8,64K,1M,25M,256M)
      --net-gbit G         each host's network bandwidth per direction (default 200)
      --net-latency-us T   one network step's latency (default 10)
      --local-latency-us T one shared-memory collective's latency (default 2)
      --local-gbps B       a shared-memory collective's rate, bytes per second of one rank's
                           buffer (default 8: loom-bench's all_reduce at 8 ranks per host)
      --mem-gbps B         copy bandwidth per rank, read + write (default 20)
  DDP weak scaling (instead of the table): the all_reduces of one training step
      --ddp-bytes S        gradient bytes per step
      --bucket-bytes S     DDP's bucket size (default 25M)
      --compute-ms T       forward + backward + optimizer time per step
      --overlap F          part of the compute that is the backward pass, which produces
                           the buckets and hides their all_reduces (default 2/3)
  -h, --help

Each row: the most network steps and bytes sent by any rank and any host, the simulated
time of the slowest rank, algbw = size / time, and hostbw = algbw x the nccl-tests factor
with P = hosts (each host's link rate). "ok" means every rank finished with every message
matched under rendezvous sends.
)";

[[noreturn]] void usageError(const std::string& what) {
  std::cerr << "loom-schedule: " << what << "\n\n" << kUsage;
  std::exit(2);
}

size_t parseSize(const std::string& s) {
  const auto v = env::parseBytes(s);
  if (!v) usageError("'" + s + "' is not a size");
  return static_cast<size_t>(*v);
}

template <class T, class Parse>
std::vector<T> parseList(const std::string& text, Parse parse) {
  std::vector<T> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find(',', start), text.size());
    out.push_back(parse(text.substr(start, end - start)));
    start = end + 1;
  }
  return out;
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
    } else if (a == "-o" || a == "--op") {
      const auto op = parseOp(value());
      if (!op) usageError("unknown op");
      o.kind = collectiveOf(*op);
    } else if (a == "-H" || a == "--hosts") {
      o.hosts = parseList<int>(value(), [](const std::string& s) { return std::atoi(s.c_str()); });
    } else if (a == "-p" || a == "--ranks-per-host") {
      o.perHost = std::atoi(value().c_str());
    } else if (a == "-b" || a == "--bytes") {
      o.bytes = parseList<size_t>(value(), parseSize);
    } else if (a == "--net-gbit") {
      o.cost.hostNetGBps = std::atof(value().c_str()) / 8;
    } else if (a == "--net-latency-us") {
      o.cost.netLatencyUs = std::atof(value().c_str());
    } else if (a == "--local-latency-us") {
      o.cost.localLatencyUs = std::atof(value().c_str());
    } else if (a == "--mem-gbps") {
      o.cost.memGBps = std::atof(value().c_str());
    } else if (a == "--local-gbps") {
      o.cost.localGBps = std::atof(value().c_str());
    } else if (a == "--ddp-bytes") {
      o.ddpBytes = parseSize(value());
    } else if (a == "--bucket-bytes") {
      o.bucketBytes = parseSize(value());
    } else if (a == "--compute-ms") {
      o.computeMs = std::atof(value().c_str());
    } else if (a == "--overlap") {
      o.overlap = std::atof(value().c_str());
    } else {
      usageError("unknown option '" + a + "'");
    }
  }
  for (int h : o.hosts) {
    if (h < 1 || static_cast<long>(h) * o.perHost > (1 << 16)) usageError("bad --hosts");
  }
  if (o.perHost < 1) usageError("bad --ranks-per-host");
  if (o.ddpBytes != 0 && (o.computeMs <= 0 || o.bucketBytes == 0)) {
    usageError("--ddp-bytes needs --compute-ms and a bucket size");
  }
  return o;
}

std::vector<std::vector<int>> layoutOf(int hosts, int perHost) {
  std::vector<std::vector<int>> layout(static_cast<size_t>(hosts));
  for (int r = 0; r < hosts * perHost; ++r) layout[r / perHost].push_back(r);
  return layout;
}

// The simulated collective moving `bytes` (loom-bench's convention) over the layout.
ScheduleReport simulate(const Options& o, int hosts, size_t bytes) {
  const int size = hosts * o.perHost;
  SimulatedOp op;
  op.kind = o.kind;
  const size_t elements = std::max<size_t>(1, bytes / 4);
  const bool perRank = o.kind == CollectiveKind::kAllGather ||
                       o.kind == CollectiveKind::kReduceScatter ||
                       o.kind == CollectiveKind::kAllToAll || o.kind == CollectiveKind::kGather ||
                       o.kind == CollectiveKind::kScatter;
  op.count = perRank ? std::max<size_t>(1, elements / size) : elements;
  const auto layout = layoutOf(hosts, o.perHost);
  return checkSchedules(layout, recordSchedules(layout, op), o.cost);
}

double hostFactor(CollectiveKind kind, int hosts) {
  switch (kind) {
    case CollectiveKind::kAllReduce: return 2.0 * (hosts - 1) / hosts;
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllToAll: return static_cast<double>(hosts - 1) / hosts;
    default: return 1.0;
  }
}

int table(const Options& o) {
  std::printf(
      "# loom-schedule: %s, %d ranks per host; network %.0f Gb/s per host and %.1f us "
      "per step; local collectives %.1f us + %.1f GB/s; memory %.0f GB/s per rank\n",
      std::string(collectiveName(o.kind)).c_str(), o.perHost, o.cost.hostNetGBps * 8,
      o.cost.netLatencyUs, o.cost.localLatencyUs, o.cost.localGBps, o.cost.memGBps);
  std::printf("# %6s %7s %12s %6s %12s %12s %12s %9s %9s  %s\n", "hosts", "ranks", "bytes", "steps",
              "sent/rank", "sent/host", "time(us)", "algbw", "hostbw", "check");
  int bad = 0;
  for (int h : o.hosts) {
    for (size_t bytes : o.bytes) {
      const ScheduleReport r = simulate(o, h, bytes);
      const double algbw = static_cast<double>(bytes) / r.timeUs / 1e3;
      std::printf("  %6d %7d %12zu %6zu %12zu %12zu %12.1f %9.3f %9.3f  %s\n", h, h * o.perHost,
                  bytes, r.maxNetworkSteps, r.maxSentBytes, r.maxHostSentBytes, r.timeUs, algbw,
                  algbw * hostFactor(o.kind, h), r.error.empty() ? "ok" : r.error.c_str());
      std::fflush(stdout);
      bad += r.error.empty() ? 0 : 1;
    }
  }
  return bad == 0 ? 0 : 1;
}

// DDP weak scaling. The backward pass (`overlap` of the compute) produces the gradient
// buckets at an even pace, last layer first; each bucket's all_reduce starts once it is ready
// and the previous one is done (one at a time, as DDP issues them on one process group), and
// the step ends when the backward and the last all_reduce both have. So communication hides
// behind the backward except what the last buckets leave exposed. Efficiency is the step
// time on one host over that on H hosts (the definition of the XCCL Aurora figures:
// per-rank throughput normalised to one node).
int ddp(const Options& o) {
  std::printf(
      "# DDP weak scaling: %.1f MiB of gradients in %.1f MiB buckets, %.1f ms of compute "
      "per step (%.0f%% of it the backward pass), %d ranks per host, %.0f Gb/s\n",
      o.ddpBytes / 1048576.0, o.bucketBytes / 1048576.0, o.computeMs, o.overlap * 100, o.perHost,
      o.cost.hostNetGBps * 8);
  std::printf("# %6s %7s %14s %14s %14s %11s  %s\n", "hosts", "ranks", "allreduce(ms)",
              "exposed(ms)", "step(ms)", "efficiency", "check");
  std::vector<size_t> buckets;
  for (size_t left = o.ddpBytes; left > 0; left -= buckets.back()) {
    buckets.push_back(std::min(left, o.bucketBytes));
  }
  struct Step {
    double commMs = 0, exposedMs = 0, stepMs = 0;
  };
  std::string error;
  auto stepOn = [&](int hosts) {
    Step st;
    const double backward = o.overlap * o.computeMs;
    double done = 0;  // when the last all_reduce issued so far ends
    for (size_t i = 0; i < buckets.size(); ++i) {
      const ScheduleReport r = simulate(o, hosts, buckets[i]);
      if (!r.error.empty()) error = r.error;
      const double ready = backward * static_cast<double>(i + 1) / buckets.size();
      done = std::max(done, ready) + r.timeUs / 1e3;
      st.commMs += r.timeUs / 1e3;
    }
    st.exposedMs = std::max(0.0, done - backward);
    st.stepMs = o.computeMs + st.exposedMs;
    return st;
  };
  const Step base = stepOn(1);
  std::printf("  %6d %7d %14.2f %14.2f %14.2f %10.1f%%  (one host: the reference)\n", 1, o.perHost,
              base.commMs, base.exposedMs, base.stepMs, 100.0);
  for (int h : o.hosts) {
    const Step st = stepOn(h);
    std::printf("  %6d %7d %14.2f %14.2f %14.2f %10.1f%%  %s\n", h, h * o.perHost, st.commMs,
                st.exposedMs, st.stepMs, base.stepMs / st.stepMs * 100,
                error.empty() ? "ok" : error.c_str());
    std::fflush(stdout);
  }
  return error.empty() ? 0 : 1;
}

}  // namespace
}  // namespace loom::bench

int main(int argc, char** argv) {
  const loom::bench::Options options = loom::bench::parse(argc, argv);
  return options.ddpBytes != 0 ? loom::bench::ddp(options) : loom::bench::table(options);
}
