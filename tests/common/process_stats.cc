// Reads /proc/self for the leak checks.

#include "process_stats.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
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

std::string describeFds() {
  std::string out;
  for (const std::string& fd : listDirectory("/proc/self/fd")) {
    char target[256] = {};
    const std::string link = "/proc/self/fd/" + fd;
    if (::readlink(link.c_str(), target, sizeof target - 1) < 0) continue;  // the listing's own
    out += "  " + fd + " -> " + target;
    // For sockets, the kernel's view (/proc/net/unix: state, path) tells who the peer is.
    const std::string t = target;
    if (t.rfind("socket:[", 0) == 0) {
      const std::string inode = t.substr(8, t.size() - 9);
      std::ifstream unix("/proc/net/unix");
      for (std::string line; std::getline(unix, line);) {
        std::istringstream f(line);
        std::string field;
        for (int i = 0; i < 7 && f >> field;) ++i;
        if (field == inode) out += "  [" + line + "]";
      }
    }
    out += "\n";
  }
  return out;
}

SharedMemoryFootprint sharedMemoryFootprint() {
  SharedMemoryFootprint footprint;
  const auto isShared = [](const std::string& path) {
    return path.rfind("/dev/shm/", 0) == 0 || path.rfind("/memfd:", 0) == 0;
  };
  for (const std::string& fd : listDirectory("/proc/self/fd")) {
    char target[512] = {};
    const std::string link = "/proc/self/fd/" + fd;
    if (::readlink(link.c_str(), target, sizeof target - 1) < 0) continue;  // the listing's own
    if (isShared(target)) footprint.held.push_back(std::string("fd ") + target);
  }
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    // The path is the sixth field and may contain spaces ("(deleted)").
    const size_t slash = line.find('/');
    if (slash != std::string::npos && isShared(line.substr(slash))) {
      footprint.held.push_back("map " + line.substr(slash));
    }
  }
  std::sort(footprint.held.begin(), footprint.held.end());
  for (const std::string& name : listDirectory("/dev/shm")) {
    std::string lower = name;
    std::transform(lower.begin(), lower.end(), lower.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (lower.find("loom") != std::string::npos) footprint.loomNames.push_back(name);
  }
  return footprint;
}

std::string describe(const SharedMemoryFootprint& footprint) {
  const auto join = [](const std::vector<std::string>& items) {
    std::string out;
    for (const std::string& item : items) out += (out.empty() ? "" : ", ") + item;
    return "[" + out + "]";
  };
  return "held " + join(footprint.held) + ", loom names in /dev/shm " + join(footprint.loomNames);
}

}  // namespace loom::testing
