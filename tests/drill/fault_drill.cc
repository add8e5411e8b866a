// loom-fault-drill: injects each fault of docs/RELIABILITY.md into real forked ranks several
// times and prints a Markdown table: what the survivors got, how long detection took
// (median and worst, from the fault to the survivor's error) and what was left behind
// (fds, segment mappings and threads after tearing down, /dev/shm entries).
//   loom-fault-drill [--ranks P] [--repeats N]

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../common/forked_ranks.h"
#include "../common/process_stats.h"
#include "loom/error.h"

namespace loom {
namespace {

using testing::RankContext;
using Clock = std::chrono::steady_clock;

// Steady-clock nanoseconds: CLOCK_MONOTONIC is one clock for every process of the host.
int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

void publishFaultTime(RankContext& ctx) {
  const std::string t = std::to_string(nowNs());
  ctx.store->set("fault_ns", Bytes(t.begin(), t.end()));
}

// Set by a survivor whose detection is measured from its own call instead (a rank that
// died before the call is found at the call).
int64_t gCallNs = 0;

int64_t faultTime(RankContext& ctx) {
  const Bytes b = ctx.store->get("fault_ns", std::chrono::seconds(60));
  return std::stoll(std::string(b.begin(), b.end()));
}

// One fault: `victim` is the rank that misbehaves; `act` is what it does; `wait` is what
// the survivors do (it must throw the survivor's Error).
struct Fault {
  const char* name;
  int victim;
  std::function<void(RankContext&, Communicator&)> act;
  std::function<void(RankContext&, Communicator&)> wait;
  std::chrono::milliseconds timeout{60000};
};

void waitInAllReduce(RankContext&, Communicator& comm) {
  std::vector<float> v(1024, 1.0f);
  comm.allReduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceKind::kSum).wait();
}

void dieSoon(RankContext& ctx, Communicator&) {
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the others are waiting
  publishFaultTime(ctx);
  ::raise(SIGKILL);
}

std::vector<Fault> faults() {
  return {
      {"kill -9 while the others wait in all_reduce", 1, dieSoon, waitInAllReduce},
      {"kill -9 while a peer waits in recv from it", 1, dieSoon,
       [](RankContext& ctx, Communicator& comm) {
         if (ctx.rank != 0) return waitInAllReduce(ctx, comm);
         float x;
         comm.recv(&x, 1, DataType::kFloat32, 1, 0).wait();
       }},
      {"kill -9 of rank 0, which created the shared segment", 0, dieSoon, waitInAllReduce},
      {"kill -9 between collectives; the others call the next one (ms from the call)", 1,
       [](RankContext& ctx, Communicator&) {
         publishFaultTime(ctx);
         ::raise(SIGKILL);
       },
       [](RankContext& ctx, Communicator& comm) {
         faultTime(ctx);
         std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let it die
         gCallNs = nowNs();
         waitInAllReduce(ctx, comm);
       }},
      {"an exception unwinds one rank (communicator destroyed)", 1,
       [](RankContext& ctx, Communicator&) {
         std::this_thread::sleep_for(std::chrono::milliseconds(50));
         publishFaultTime(ctx);
         throw std::runtime_error("user code failed");
       },
       waitInAllReduce},
      {"abort() on one rank while the others wait", 1,
       [](RankContext& ctx, Communicator& comm) {
         std::this_thread::sleep_for(std::chrono::milliseconds(50));
         publishFaultTime(ctx);
         comm.abort();
       },
       waitInAllReduce},
      {"one rank never calls the collective (timeout 1 s)", 1,
       [](RankContext& ctx, Communicator&) {
         publishFaultTime(ctx);
         ctx.store->get("drill_done", std::chrono::seconds(60));
       },
       [](RankContext& ctx, Communicator& comm) {
         faultTime(ctx);
         waitInAllReduce(ctx, comm);
       },
       std::chrono::milliseconds(1000)},
  };
}

struct Sample {
  std::vector<double> detectMs;
  std::map<std::string, int> outcomes;  // error code name -> survivors
  std::string leftBehind;
  std::string example;
  std::string report;  // one survivor's failure report, as printed on stderr
};

// Runs `fault` once; survivors print "DETECT <ms> <code>" and "LEAK <text>" lines.
void runOnce(const Fault& fault, int ranks, Sample& sample) {
  testing::RunOptions options;
  options.timeout = std::chrono::seconds(120);
  const auto outcomes = testing::runRanks(
      ranks,
      [&fault](RankContext& ctx) {
        ctx.connect()->barrier().wait();  // warm the per-process parts up
        const auto before = testing::sampleProcess();
        const auto shmBefore = testing::sharedMemoryFootprint();
        CommOptions commOptions;
        commOptions.timeout = fault.timeout;
        auto comm = ctx.connect(commOptions);
        comm->barrier().wait();
        if (ctx.rank == fault.victim) {
          fault.act(ctx, *comm);
          return;
        }
        try {
          fault.wait(ctx, *comm);
          std::printf("DETECT none\n");
        } catch (const Error& e) {
          const int64_t from = gCallNs != 0 ? gCallNs : faultTime(ctx);
          const double ms = static_cast<double>(nowNs() - from) / 1e6;
          std::string code(errorCodeName(e.code()));
          std::replace(code.begin(), code.end(), ' ', '_');  // one word for the parser
          std::printf("DETECT %.3f %s\nEXAMPLE %s\n", ms, code.c_str(), e.what());
        }
        comm.reset();
        const auto after = testing::sampleProcess();
        std::string leak;
        if (after.fds != before.fds) leak += std::to_string(after.fds - before.fds) + " fds ";
        if (after.loomMappings != before.loomMappings) leak += "mappings ";
        if (after.threads != before.threads)
          leak += std::to_string(after.threads - before.threads) + " threads ";
        if (testing::sharedMemoryFootprint() != shmBefore) leak += "shared memory ";
        std::printf("LEAK %s\n", leak.empty() ? "nothing" : leak.c_str());
        if (ctx.rank != fault.victim) ctx.store->set("drill_done", {1});
        std::fflush(stdout);
      },
      options);
  for (const auto& o : outcomes) {
    if (o.rank == fault.victim) continue;
    std::istringstream lines(o.output);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("DETECT ", 0) == 0) {
        std::istringstream f(line.substr(7));
        double ms = 0;
        std::string code;
        if (f >> ms >> code) {
          sample.detectMs.push_back(ms);
          ++sample.outcomes[code];
        } else {
          ++sample.outcomes["no error (!)"];
        }
      } else if (line.rfind("EXAMPLE ", 0) == 0 && sample.example.empty()) {
        sample.example = line.substr(8);
      } else if (line.rfind("LEAK ", 0) == 0 && line != "LEAK nothing") {
        sample.leftBehind = line.substr(5);
      }
    }
    if (sample.report.empty()) {
      // The report runs from its first "loom: " line up to the first line of the drill's.
      const size_t from = o.output.find("loom: communicator");
      const size_t to = o.output.find("DETECT ", from == std::string::npos ? 0 : from);
      if (from != std::string::npos) sample.report = o.output.substr(from, to - from);
    }
    if (!o.exited || o.status != 0) ++sample.outcomes["survivor failed (!)"];
  }
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

}  // namespace
}  // namespace loom

int main(int argc, char** argv) {
  int ranks = 4, repeats = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--ranks") == 0) ranks = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--repeats") == 0) repeats = std::atoi(argv[i + 1]);
  }
  std::printf(
      "| fault | survivors got | detection median / max (ms) | left behind | example message |\n");
  std::printf("|---|---|---|---|---|\n");
  std::string firstReport;
  for (const loom::Fault& fault : loom::faults()) {
    loom::Sample sample;
    for (int r = 0; r < repeats; ++r) {
      std::fprintf(stderr, "\r%s: %d/%d", fault.name, r + 1, repeats);
      loom::runOnce(fault, ranks, sample);
    }
    std::fprintf(stderr, "\n");
    std::string got;
    for (const auto& [code, n] : sample.outcomes) {
      got += (got.empty() ? "" : ", ") + code + " x" + std::to_string(n);
    }
    std::string example = sample.example.substr(0, 240);
    std::replace(example.begin(), example.end(), '|', '/');
    std::printf("| %s | %s | %.1f / %.1f | %s | %s |\n", fault.name, got.c_str(),
                loom::percentile(sample.detectMs, 0.5), loom::percentile(sample.detectMs, 1.0),
                sample.leftBehind.empty() ? "nothing" : sample.leftBehind.c_str(), example.c_str());
    std::fflush(stdout);
    if (firstReport.empty()) firstReport = sample.report;
  }
  std::printf("\nThe failure report one survivor of the first fault printed:\n\n```\n%s```\n",
              firstReport.c_str());
  return 0;
}
