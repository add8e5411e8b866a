#pragma once

// What the threads of this process did between two looks, from the kernel's own accounting
// (/proc/self/task/*/schedstat and status): CPU time, times scheduled in, time spent
// runnable but waiting for a core, switches forced on them. loom-bench --census uses it to
// say which of loom's threads ran while a small collective stalled, and whether the calling
// thread was pushed off its core; tests use it to count a loom thread's wake-ups.

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>

namespace loom::testing {

/// One thread's counters since it started.
struct ThreadCounters {
  std::string name;          ///< its comm name (loom names its threads "loom-...")
  uint64_t runNs = 0;        ///< time on a CPU
  uint64_t waitNs = 0;       ///< time runnable, waiting for a CPU (0 without schedstats)
  uint64_t slices = 0;       ///< times it was scheduled in
  uint64_t involuntary = 0;  ///< times it was switched out while still runnable
};

/// Every thread of this process, by thread id.
using ThreadSnapshot = std::map<pid_t, ThreadCounters>;

/// Reads the counters of every thread of this process now.
ThreadSnapshot snapshotThreads();

/// The groups loom-bench reports: the calling (main) thread and loom's threads by role.
enum class ThreadGroup { kCaller, kWorker, kHelpers, kP2p, kOther, kCount };

/// Totals per group between two snapshots (threads that started in between count from 0).
struct GroupDelta {
  double runUs = 0;
  double waitUs = 0;
  double slices = 0;
  double involuntary = 0;
};

/// What each group did between `before` and `after`.
std::map<ThreadGroup, GroupDelta> groupDeltas(const ThreadSnapshot& before,
                                              const ThreadSnapshot& after);

/// The group's name in reports.
const char* groupName(ThreadGroup group);

/// Whole-machine CPU seconds so far, from /proc/stat.
struct MachineTimes {
  double busy = 0;   ///< not idle, not waiting for I/O: with loom's own CPU time, what others ran
  double steal = 0;  ///< taken by the hypervisor for other guests while this one could run
};

/// The machine's CPU seconds so far.
MachineTimes machineTimes();

}  // namespace loom::testing
