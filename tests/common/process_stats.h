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

/// The names in /dev/shm (sorted); loom must never add one.
std::vector<std::string> devShmEntries();

}  // namespace loom::testing
