// Host identity from the kernel's boot id and namespace inodes.

#include "core/topology.h"

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <string_view>

#include "util/comm_id.h"

namespace loom {

namespace {

uint64_t namespaceInode(const char* path) {
  struct stat st {};
  return ::stat(path, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// The file's first word (up to a space or line end), or "" if it cannot be read. (C stdio,
// not a stream: see tests/lint/check_messages.py.)
std::string firstWordOf(const char* path) {
  FILE* file = std::fopen(path, "r");
  if (file == nullptr) return {};
  char text[128] = {};
  const size_t n = std::fread(text, 1, sizeof text - 1, file);
  std::fclose(file);
  const std::string_view read(text, n);
  return std::string(read.substr(0, read.find_first_of(" \t\n")));
}

}  // namespace

HostInfo localHost() {
  // Read at each call, a few system calls: a value kept from the first call was wrong in a
  // forked child that had entered another network namespace since (its ranks took a peer on
  // another namespace host for one of theirs, and read its memory directly).
  HostInfo info;
  const std::string bootId = firstWordOf("/proc/sys/kernel/random/boot_id");
  const uint64_t netns = namespaceInode("/proc/self/ns/net");
  info.pidNamespace = namespaceInode("/proc/self/ns/pid");
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  info.hostname = name;
  // Same boot id and network namespace: same kernel, and abstract sockets reach each other.
  info.id = deriveId(CommId{}, bootId + "/" + std::to_string(netns));
  info.machine = deriveId(CommId{}, bootId);
  return info;
}

HostMap::HostMap(std::span<const HostId> hostOfRank) {
  std::map<HostId, int> numbers;
  for (const HostId& id : hostOfRank) {
    const auto [at, added] = numbers.try_emplace(id, static_cast<int>(ranksOn_.size()));
    if (added) ranksOn_.emplace_back();
    const int h = at->second;
    const int rank = static_cast<int>(hostOf_.size());
    hostOf_.push_back(h);
    localIndex_.push_back(static_cast<int>(ranksOn_[h].size()));
    ranksOn_[h].push_back(rank);
  }
}

const std::vector<int>& processCpus() {
  static const std::vector<int> cpus = [] {
    std::vector<int> list;
    cpu_set_t set;
    CPU_ZERO(&set);
    if (::sched_getaffinity(0, sizeof set, &set) == 0) {
      for (int c = 0; c < CPU_SETSIZE; ++c) {
        if (CPU_ISSET(c, &set)) list.push_back(c);
      }
    }
    return list;
  }();
  return cpus;
}

int availableCores() {
  return std::max(1, static_cast<int>(processCpus().size()));
}

}  // namespace loom
