#pragma once

// What a process holds, read from /proc/self, for leak checks: tests sample before and
// after (a soak, a failure, a torn-down communicator) and compare.

#include <string>
#include <vector>

namespace loom::testing {

/// A snapshot of this process's resources.
struct ProcessStats {
  int fds = 0;           ///< open file descriptors
  long rssKiB = 0;       ///< resident set size
  int threads = 0;       ///< threads, this one included
  int loomMappings = 0;  ///< mappings of loom's memfd segments ("/memfd:loom")
};

/// Samples /proc/self now.
ProcessStats sampleProcess();

/// "fds 12, rss 10240 KiB, threads 3, loom mappings 1" (for messages).
std::string describe(const ProcessStats& stats);

/// One line per open descriptor: "fd -> what it refers to" (for leak messages).
std::string describeFds();

/// loom's footprint in shared memory, as far as this process can see it. Leak checks compare
/// it before and after; unlike a listing of all of /dev/shm it does not change when another
/// program on the machine makes or removes shared memory meanwhile.
struct SharedMemoryFootprint {
  /// Files under /dev/shm and memfds that this process holds open or mapped, one entry per
  /// descriptor or mapping ("fd /dev/shm/x", "map /memfd:loom (deleted)"), sorted.
  std::vector<std::string> held;
  /// Names in /dev/shm that loom could have written: any containing "loom" (loom itself
  /// names nothing there: its segments are memfds), sorted.
  std::vector<std::string> loomNames;

  bool operator==(const SharedMemoryFootprint&) const = default;
};

/// Samples this process's footprint now.
SharedMemoryFootprint sharedMemoryFootprint();

/// "held [...], loom names in /dev/shm [...]" (for messages).
std::string describe(const SharedMemoryFootprint& footprint);

}  // namespace loom::testing
