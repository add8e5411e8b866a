// Per-thread scheduler counters from /proc, grouped by loom's thread names.

#include "thread_census.h"

#include <dirent.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

namespace loom::testing {

namespace {

std::string taskPath(pid_t tid, const char* file) {
  return "/proc/self/task/" + std::to_string(tid) + "/" + file;
}

ThreadGroup groupOf(pid_t tid, const std::string& name) {
  if (tid == ::getpid()) return ThreadGroup::kCaller;
  if (name == "loom-worker") return ThreadGroup::kWorker;
  if (name.rfind("loom-helper", 0) == 0) return ThreadGroup::kHelpers;
  if (name == "loom-p2p") return ThreadGroup::kP2p;
  return ThreadGroup::kOther;
}

}  // namespace

ThreadSnapshot snapshotThreads() {
  ThreadSnapshot snapshot;
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return snapshot;
  while (const dirent* entry = ::readdir(dir)) {
    const pid_t tid = static_cast<pid_t>(std::atoi(entry->d_name));
    if (tid <= 0) continue;
    ThreadCounters c;
    std::ifstream(taskPath(tid, "comm")) >> c.name;
    // schedstat: ns on a CPU, ns runnable waiting for one, times scheduled in.
    std::ifstream(taskPath(tid, "schedstat")) >> c.runNs >> c.waitNs >> c.slices;
    std::ifstream status(taskPath(tid, "status"));
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("nonvoluntary_ctxt_switches:", 0) == 0)
        c.involuntary = std::strtoull(line.c_str() + line.find(':') + 1, nullptr, 10);
    }
    snapshot[tid] = c;  // a thread that exited meanwhile reads as zeros (groupDeltas skips it)
  }
  ::closedir(dir);
  return snapshot;
}

std::map<ThreadGroup, GroupDelta> groupDeltas(const ThreadSnapshot& before,
                                              const ThreadSnapshot& after) {
  std::map<ThreadGroup, GroupDelta> groups;
  for (int g = 0; g < static_cast<int>(ThreadGroup::kCount); ++g)
    groups[static_cast<ThreadGroup>(g)] = {};
  for (const auto& [tid, now] : after) {
    ThreadCounters then;
    if (const auto it = before.find(tid); it != before.end()) then = it->second;
    // A thread whose files could not all be read now (it was exiting) reads as zeros in
    // some counter: skip it rather than count a counter that went backwards.
    if (now.runNs < then.runNs || now.waitNs < then.waitNs || now.slices < then.slices ||
        now.involuntary < then.involuntary) {
      continue;
    }
    GroupDelta& d = groups[groupOf(tid, now.name)];
    d.runUs += static_cast<double>(now.runNs - then.runNs) / 1e3;
    d.waitUs += static_cast<double>(now.waitNs - then.waitNs) / 1e3;
    d.slices += static_cast<double>(now.slices - then.slices);
    d.involuntary += static_cast<double>(now.involuntary - then.involuntary);
  }
  return groups;
}

const char* groupName(ThreadGroup group) {
  switch (group) {
    case ThreadGroup::kCaller: return "caller";
    case ThreadGroup::kWorker: return "worker";
    case ThreadGroup::kHelpers: return "helpers";
    case ThreadGroup::kP2p: return "p2p";
    default: return "other";
  }
}

MachineTimes machineTimes() {
  std::ifstream stat("/proc/stat");
  std::string cpu;
  uint64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  const double tick = 1.0 / static_cast<double>(::sysconf(_SC_CLK_TCK));
  return {static_cast<double>(user + nice + system + irq + softirq) * tick,
          static_cast<double>(steal) * tick};
}

}  // namespace loom::testing
