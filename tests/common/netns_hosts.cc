// Network namespaces and veth pairs through iproute2.

#include "netns_hosts.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <regex>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <thread>

namespace loom::testing {

namespace {

// Runs a shell command; throws with its output if it fails.
void run(const std::string& command) {
  const std::string full = command + " 2>&1";
  FILE* pipe = ::popen(full.c_str(), "r");
  if (!pipe) throw std::runtime_error("cannot run: " + command);
  std::string output;
  char buffer[256];
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) output.append(buffer, n);
  const int status = ::pclose(pipe);
  if (status != 0) throw std::runtime_error("`" + command + "` failed: " + output);
}

std::atomic<int> madeHere{0};

// Removes the namespaces of test processes that are gone (killed before their destructor
// ran): loom tests name theirs loom<pid>n<k>..., so a dead pid's are nobody's.
void reapOrphans() {
  DIR* dir = ::opendir("/var/run/netns");
  if (!dir) return;
  static const std::regex ours("loom([0-9]+)(n|py)[0-9a-z]*");
  while (dirent* entry = ::readdir(dir)) {
    std::cmatch match;
    if (!std::regex_match(entry->d_name, match, ours)) continue;
    const long pid = std::strtol(match[1].str().c_str(), nullptr, 10);
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    std::system(("ip netns del " + std::string(entry->d_name) + " 2>/dev/null").c_str());
  }
  ::closedir(dir);
}

}  // namespace

std::string NetnsHosts::unavailableReason() {
  if (::geteuid() != 0) return "network namespaces need root";
  if (std::system("ip -V >/dev/null 2>&1") != 0) return "iproute2 (the ip command) is missing";
  return "";
}

NetnsHosts::NetnsHosts(int hosts) {
  reapOrphans();
  const std::string prefix =
      "loom" + std::to_string(::getpid()) + "n" + std::to_string(madeHere.fetch_add(1));
  hub_ = prefix + "hub";
  try {
    run("ip netns add " + hub_);
    run("ip -n " + hub_ + " link add br0 type bridge");
    run("ip -n " + hub_ + " link set br0 up");
    for (int h = 0; h < hosts; ++h) {
      const std::string name = prefix + "h" + std::to_string(h);
      run("ip netns add " + name);
      names_.push_back(name);
      const std::string port = "p" + std::to_string(h);
      run("ip -n " + hub_ + " link add " + port + " type veth peer name eth0 netns " + name);
      run("ip -n " + hub_ + " link set " + port + " master br0 up");
      run("ip -n " + name + " addr add " + address(h) + "/24 dev eth0");
      run("ip -n " + name + " link set eth0 up");
      run("ip -n " + name + " link set lo up");
    }
    awaitRunning();
  } catch (...) {
    removeAll();
    throw;
  }
}

void NetnsHosts::awaitRunning() const {
  // The kernel reports a link's operational state (IFF_RUNNING) through its link-watch
  // work, which may lag a second behind `ip link set up` on a loaded machine; libfabric
  // offers only running interfaces, so a rank that started before would see loopback alone
  // and publish 127.0.0.1 (seen once in CI: a peer's connection refused).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (const std::string& name : names_) {
    const std::string check =
        "ip -n " + name + " -o link show eth0 | grep -q 'state UP' >/dev/null 2>&1";
    while (std::system(check.c_str()) != 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        throw std::runtime_error("eth0 of network namespace " + name + " did not come up in 10 s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

NetnsHosts::~NetnsHosts() {
  removeAll();
}

void NetnsHosts::removeAll() {
  // Deleting a namespace deletes its interfaces, and a veth pair goes with either end.
  for (const std::string& name : names_)
    std::system(("ip netns del " + name + " 2>/dev/null").c_str());
  if (!hub_.empty()) std::system(("ip netns del " + hub_ + " 2>/dev/null").c_str());
  names_.clear();
  hub_.clear();
}

void NetnsHosts::enter(int h) const {
  const std::string path = "/var/run/netns/" + names_.at(h);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("cannot enter network namespace " + names_.at(h));
  }
  ::close(fd);
}

std::string NetnsHosts::address(int h) const {
  return "10.77.0." + std::to_string(h + 1);
}

void NetnsHosts::shape(int h, double gbit) const {
  // The bucket holds 2 ms at the rate (at least 64 KiB), enough that the kernel's timer
  // granularity does not hold the link below its rate.
  const auto bytesPerSecond = static_cast<long long>(gbit * 1e9 / 8);
  const long long burst = std::max<long long>(bytesPerSecond / 500, 64 << 10);
  const std::string tbf = " root tbf rate " + std::to_string(static_cast<long long>(gbit * 1e6)) +
                          "kbit burst " + std::to_string(burst) + " latency 50ms";
  run("ip netns exec " + names_.at(h) + " tc qdisc replace dev eth0" + tbf);
  run("ip netns exec " + hub_ + " tc qdisc replace dev p" + std::to_string(h) + tbf);
}

void NetnsHosts::setLink(int h, bool up) const {
  run("ip -n " + hub_ + " link set p" + std::to_string(h) + (up ? " up" : " down"));
}

void NetnsHosts::cutBetween(int a, int b) const {
  // A permanent neighbour entry with a hardware address no interface has: the packets
  // leave, and nothing answers (no error, as on a cut cable between two racks).
  const auto cut = [&](int from, int to, const char* nowhere) {
    run("ip -n " + names_[from] + " neigh replace " + address(to) + " lladdr " + nowhere +
        " dev eth0 nud permanent");
  };
  cut(a, b, "02:00:00:00:00:99");
  cut(b, a, "02:00:00:00:00:98");
}

}  // namespace loom::testing
