// Reads /proc/self for the leak checks.

#include "process_stats.h"

#include <dirent.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace loom::testing {

namespace {

// Entries of a directory other than "." and "..".
std::vector<std::string> listDirectory(const char* path) {
  std::vector<std::string> names;
  DIR* dir = ::opendir(path);
  if (dir == nullptr) return names;
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

ProcessStats sampleProcess() {
  ProcessStats stats;
  // The directory stream itself holds one descriptor while we count.
  stats.fds = static_cast<int>(listDirectory("/proc/self/fd").size()) - 1;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    std::istringstream fields(line);
    std::string key;
    fields >> key;
    if (key == "VmRSS:") fields >> stats.rssKiB;
    if (key == "Threads:") fields >> stats.threads;
  }
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    // Segments are memfds named "loom"; the mapping outlives the fd, hence "(deleted)".
    if (line.find("/memfd:loom (deleted)") != std::string::npos) ++stats.loomMappings;
  }
  return stats;
}

std::string describe(const ProcessStats& stats) {
  return "fds " + std::to_string(stats.fds) + ", rss " + std::to_string(stats.rssKiB) +
         " KiB, threads " + std::to_string(stats.threads) + ", loom mappings " +
         std::to_string(stats.loomMappings);
}

std::vector<std::string> devShmEntries() {
  return listDirectory("/dev/shm");
}

}  // namespace loom::testing
