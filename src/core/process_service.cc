// The per-process service thread: accepts members for local leaders and watches peers.

#include "core/process_service.h"

#include <cerrno>

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <set>
#include <string>
#include <system_error>

#include "loom/error.h"
#include "util/posix.h"
#include "util/unix_socket.h"

namespace loom {

namespace {

constexpr size_t kMaxPending = 1024;  // half-open connections held at once
constexpr size_t kMaxEarly = 4096;    // arrivals held for leaders not yet asking
constexpr auto kHelloTimeout = std::chrono::seconds(10);

int openPidfd(int pid) {
#ifdef SYS_pidfd_open
  if (pid <= 0) return -1;
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  return -1;
#endif
}

std::string randomName() {
  uint8_t bytes[12];
  posix::randomBytes(bytes, sizeof bytes);
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s = "loom." + std::to_string(::geteuid()) + "." + std::to_string(::getpid()) + ".";
  for (uint8_t b : bytes) {
    s += kDigits[b >> 4];
    s += kDigits[b & 15];
  }
  return s;
}

std::atomic<std::thread::id> gServiceThread;

// Slices of a creation wait between liveness checks.
constexpr auto kAliveSlice = std::chrono::milliseconds(50);

}  // namespace

ExitWatch::ExitWatch(const std::vector<std::pair<int, int>>& rankPids) {
  for (const auto& [rank, pid] : rankPids) {
    posix::Fd fd(openPidfd(pid));
    if (fd) {
      watched_.push_back({rank, pid, std::move(fd)});
    } else if (errno == ESRCH && !gone_) {
      gone_ = std::make_pair(rank, pid);  // exited (and reaped) already
    }
  }
}

std::optional<std::pair<int, int>> ExitWatch::exited() const {
  if (gone_) return gone_;
  for (const Watched& w : watched_) {
    pollfd pfd{w.pidfd.get(), POLLIN, 0};
    if (::poll(&pfd, 1, 0) > 0) return std::make_pair(w.rank, w.pid);
  }
  return std::nullopt;
}

ProcessService& ProcessService::instance() {
  // Leaked on purpose: the thread lives as long as the process and must never block exit.
  // A forked child gets a fresh service (the parent's thread does not exist there).
  static std::mutex mutex;
  static ProcessService* service = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (service == nullptr || owner != ::getpid()) {
    service = new ProcessService();
    owner = ::getpid();
  }
  return *service;
}

ProcessService::ProcessService() : address_(randomName()) {
  listener_ = unix_socket::listenAbstract(address_);
  wakeFd_ = posix::Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wakeFd_) posix::throwErrno("create", "eventfd");
  try {
    thread_ = std::thread([this] {
      posix::nameThisThread("loom-service");
      run();
    });
  } catch (const std::system_error& e) {
    throw Error(ErrorCode::kSystem, "create", -1,
                std::string("cannot start loom's service thread (") + e.what() +
                    "); this process or its cgroup may be at its limit of threads (ulimit -u, "
                    "pids.max): raise it or start fewer processes");
  }
  thread_.detach();
}

void ProcessService::wake() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t k = ::write(wakeFd_.get(), &one, sizeof one);
}

void ProcessService::run() {
  gServiceThread = std::this_thread::get_id();
  std::vector<pollfd> fds;
  std::vector<std::pair<int, uint64_t>> watchedPids;  // (pid, generation) of each pidfd polled
  size_t earlyBase = 0;
  std::set<int> hungUp;
  for (;;) {
    fds.clear();
    watchedPids.clear();
    fds.push_back({listener_.get(), POLLIN, 0});
    fds.push_back({wakeFd_.get(), POLLIN, 0});
    for (const Pending& p : pending_) fds.push_back({p.socket.get(), POLLIN, 0});
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& [pid, w] : watched_) {
        fds.push_back({w.pidfd.get(), POLLIN, 0});
        watchedPids.emplace_back(pid, w.generation);
      }
      // Early arrivals too: a member waiting for its leader sends nothing more, so any event
      // means it hung up (gave up, died) or broke the protocol. Without this its socket would
      // stay open here until a leader that may never come asks for it.
      earlyBase = fds.size();
      for (const auto& [id, list] : early_) {
        for (const Arrival& a : list) fds.push_back({a.socket.get(), POLLIN, 0});
      }
    }
    const int ready = ::poll(fds.data(), fds.size(), pending_.empty() ? -1 : 1000);
    if (ready < 0 && errno != EINTR) continue;
    if (fds[1].revents & POLLIN) {
      uint64_t drained;
      [[maybe_unused]] ssize_t k = ::read(wakeFd_.get(), &drained, sizeof drained);
    }
    // Only this thread adds to early_, so an fd polled above that is still in early_ is the
    // same arrival (acceptMembers may have taken it meanwhile; then it is not found).
    hungUp.clear();
    for (size_t i = earlyBase; i < fds.size(); ++i) {
      if (fds[i].revents != 0) hungUp.insert(fds[i].fd);
    }
    if (!hungUp.empty()) {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto it = early_.begin(); it != early_.end();) {
        std::erase_if(it->second, [&](const Arrival& a) { return hungUp.count(a.socket.get()); });
        it = it->second.empty() ? early_.erase(it) : std::next(it);
      }
    }
    // Pending connections first (indices shift once accept() appends).
    const size_t pendingCount = pending_.size();
    for (size_t i = pendingCount; i-- > 0;) {
      if (fds[2 + i].revents != 0) readHello(i);
    }
    const auto now = Clock::now();
    std::erase_if(pending_, [&](const Pending& p) { return !p.socket || p.deadline < now; });
    if (fds[0].revents & POLLIN) acceptConnections();
    // Exited peers: every watch of the process, one after the other.
    for (size_t i = 0; i < watchedPids.size(); ++i) {
      if ((fds[2 + pendingCount + i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const auto [pid, generation] = watchedPids[i];
      {
        // The pidfd polled may have been closed since (its last watch went), and its number
        // taken by another descriptor: an event there says nothing about this pid.
        std::lock_guard<std::mutex> lock(mutex_);
        auto polled = watched_.find(pid);
        if (polled == watched_.end() || polled->second.generation != generation) continue;
      }
      for (;;) {
        std::function<void(int)> onExit;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          auto it = std::find_if(watches_.begin(), watches_.end(),
                                 [&](const auto& w) { return w.second.pid == pid; });
          if (it == watches_.end()) {
            watched_.erase(pid);
            break;
          }
          onExit = std::move(it->second.onExit);
          firing_ = it->first;
          watches_.erase(it);
        }
        onExit(pid);
        {
          std::lock_guard<std::mutex> lock(mutex_);
          firing_ = 0;
        }
        fired_.notify_all();
      }
    }
  }
}

void ProcessService::acceptConnections() {
  for (;;) {
    posix::Fd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd) return;
    unsigned uid = 0;
    int pid = 0;
    // Only processes of our own user may join: another user's process is dropped before
    // it can send a byte we read.
    if (!unix_socket::peerCredentials(fd.get(), &uid, &pid) || uid != ::geteuid()) continue;
    if (pending_.size() >= kMaxPending) continue;
    pending_.push_back({std::move(fd), {}, pid, Clock::now() + kHelloTimeout});
  }
}

void ProcessService::readHello(size_t index) {
  Pending& p = pending_[index];
  uint8_t buffer[handshake::kHelloBytes];
  const size_t want = handshake::kHelloBytes - p.bytes.size();
  const ssize_t k = ::read(p.socket.get(), buffer, want);
  if (k < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (k <= 0) {
    p.socket = posix::Fd();  // closed or failed: dropped by the caller
    return;
  }
  p.bytes.insert(p.bytes.end(), buffer, buffer + k);
  if (p.bytes.size() < handshake::kHelloBytes) return;
  const std::optional<handshake::Hello> hello = handshake::parseHello(p.bytes);
  if (!hello) {
    p.socket = posix::Fd();
    return;
  }
  Arrival arrival{*hello, std::move(p.socket), p.peerPid};
  std::lock_guard<std::mutex> lock(mutex_);
  if (auto gaveUp = abandoned_.find(hello->comm); gaveUp != abandoned_.end()) {
    refuse(arrival, handshake::kAbandoned, gaveUp->second);
    return;
  }
  auto it = expected_.find(hello->comm);
  if (it == expected_.end() && completed_.count(hello->comm) != 0) {
    // Every rank of this communicator has joined: whoever this is (a process outside the
    // job, a second claim on a rank) is refused now rather than parked forever in early_.
    refuse(arrival, 1, "this communicator is already complete");
    return;
  }
  if (it != expected_.end()) {
    it->second.arrived.push_back(std::move(arrival));
    arrived_.notify_all();
  } else {
    size_t early = 0;
    for (const auto& [id, list] : early_) early += list.size();
    if (early < kMaxEarly) early_[hello->comm].push_back(std::move(arrival));
  }
}

void ProcessService::refuse(const Arrival& member, int32_t status, const std::string& reason) {
  const auto welcome = handshake::encodeWelcome(status, reason);
  unix_socket::sendWithFd(member.socket.get(), welcome.data(), welcome.size(), -1);
}

std::string ProcessService::leaderGaveUp(int leader, const std::string& why) {
  return "the leader of this communicator, rank " + std::to_string(leader) +
         ", gave up making it: " + why;
}

void ProcessService::abandon(const CommId& comm, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  abandonLocked(comm, reason);
}

void ProcessService::abandonLocked(const CommId& comm, const std::string& reason) {
  const auto refuseAll = [&](const std::deque<Arrival>& arrivals) {
    for (const Arrival& a : arrivals) refuse(a, handshake::kAbandoned, reason);
  };
  if (auto it = expected_.find(comm); it != expected_.end()) {
    refuseAll(it->second.arrived);
    expected_.erase(it);
  }
  if (auto it = early_.find(comm); it != early_.end()) {
    refuseAll(it->second);
    early_.erase(it);
    wake();  // the service thread may be polling those sockets: let go of them
  }
  if (abandoned_.insert_or_assign(comm, reason).second) abandonedOrder_.push_back(comm);
  if (abandonedOrder_.size() > kRememberCompleted) {
    abandoned_.erase(abandonedOrder_.front());
    abandonedOrder_.pop_front();
  }
}

std::vector<Arrival> ProcessService::acceptMembers(
    const CommId& comm, const handshake::Secret& secret, int count, std::span<const int> ranks,
    Clock::time_point deadline, const StillAlive& stillAlive, std::string_view hint) {
  const int size = static_cast<int>(ranks.size());
  std::vector<Arrival> accepted;
  std::set<int> joined;  // local indices
  std::unique_lock<std::mutex> lock(mutex_);
  abandoned_.erase(comm);  // led now (ids do not repeat today; if one did, it would be new)
  Expectation& expectation = expected_[comm];
  expectation.secret = secret;
  expectation.size = size;
  if (auto it = early_.find(comm); it != early_.end()) {
    for (Arrival& a : it->second) expectation.arrived.push_back(std::move(a));
    early_.erase(it);
    // The service thread may be polling these sockets (as early arrivals): make it let go, so
    // closing a refused one below reaches its peer at once (poll holds a file reference).
    wake();
  }
  // Giving up: every member hears why, those accepted already (waiting for their welcome),
  // those queued and those still to come.
  auto giveUp = [&](const std::string& why) {
    const std::string reason = leaderGaveUp(ranks[0], why);
    for (const Arrival& a : accepted) refuse(a, handshake::kAbandoned, reason);
    abandonLocked(comm, reason);
  };
  while (static_cast<int>(accepted.size()) < count) {
    if (expectation.arrived.empty()) {
      if (stillAlive) {
        try {
          stillAlive();
        } catch (const std::exception& e) {
          const auto* error = dynamic_cast<const Error*>(&e);
          giveUp(error ? error->detail() : e.what());
          throw;
        }
      }
      const auto until = stillAlive ? std::min(deadline, Clock::now() + kAliveSlice) : deadline;
      if (arrived_.wait_until(lock, until) == std::cv_status::timeout && Clock::now() >= deadline &&
          expectation.arrived.empty()) {
        std::string missing;
        for (int r = 1; r < size; ++r) {
          if (joined.count(r) == 0) {
            missing += (missing.empty() ? "" : ", ") + std::to_string(ranks[r]);
          }
        }
        const std::string why = "rank(s) " + missing + " never connected to this leader";
        giveUp(why + " in time");
        throw Error(ErrorCode::kTimeout, "create", ranks[0], why + "; " + std::string(hint));
      }
      continue;
    }
    Arrival a = std::move(expectation.arrived.front());
    expectation.arrived.pop_front();
    if (!handshake::secretsEqual(a.hello.secret, secret)) {
      refuse(a, 1, "wrong job secret");
    } else if (a.hello.rank <= 0 || a.hello.rank >= size || joined.count(a.hello.rank) != 0) {
      refuse(a, 1, "rank out of range or already joined");
    } else {
      joined.insert(a.hello.rank);
      accepted.push_back(std::move(a));
    }
  }
  // Whoever queued behind the last member is told why, not just hung up on.
  for (Arrival& a : expectation.arrived) refuse(a, 1, "this communicator is already complete");
  expected_.erase(comm);
  if (completed_.insert(comm).second) completedOrder_.push_back(comm);
  if (completedOrder_.size() > kRememberCompleted) {
    completed_.erase(completedOrder_.front());
    completedOrder_.pop_front();
  }
  return accepted;
}

posix::Fd ProcessService::introduce(const std::string& address, const handshake::Hello& hello,
                                    int rank, Clock::time_point deadline,
                                    const StillAlive& stillAlive) {
  posix::Fd socket;
  auto pause = std::chrono::milliseconds(1);
  while (!(socket = unix_socket::connectAbstract(address))) {
    if (stillAlive) stillAlive();
    if (Clock::now() >= deadline) {
      throw Error(ErrorCode::kTimeout, "create", rank,
                  "could not reach the leader's socket '" + address +
                      "'; is the leader alive and on this host?");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  // The leader's address comes from the store, which anyone who reaches its port can write:
  // talk only to a process of our own user, so a process of another user that put its own
  // socket there never gets our Hello (and its secret) nor makes us map memory it controls.
  unsigned leaderUid = 0;
  int leaderPid = 0;
  if (!unix_socket::peerCredentials(socket.get(), &leaderUid, &leaderPid) ||
      leaderUid != ::geteuid()) {
    throw Error(ErrorCode::kPeerFailure, "create", rank,
                "the process at the leader's socket '" + address + "' runs as uid " +
                    std::to_string(leaderUid) + ", not as this process's uid " +
                    std::to_string(::geteuid()) +
                    "; refusing to join (a store written by another user?)");
  }
  const auto bytes = handshake::encodeHello(hello);
  if (!posix::writeAll(socket.get(), bytes.data(), bytes.size())) {
    throw Error(ErrorCode::kPeerFailure, "create", rank, "the leader closed the connection");
  }
  return socket;
}

ProcessService::Welcomed ProcessService::joinLeader(const std::string& address,
                                                    const handshake::Hello& hello, int rank,
                                                    Clock::time_point deadline,
                                                    const StillAlive& stillAlive) {
  posix::Fd socket = introduce(address, hello, rank, deadline, stillAlive);
  uint8_t reply[handshake::kWelcomeBytes];
  posix::Fd segment;
  // The welcome is one small message: a slice that ends without it has read nothing of it.
  for (;;) {
    const auto until = stillAlive ? std::min(deadline, Clock::now() + kAliveSlice) : deadline;
    if (unix_socket::recvWithFd(socket.get(), reply, sizeof reply, &segment, until)) break;
    if (Clock::now() < until) {  // not a slice that ran out: the connection ended
      // A leader that died closes its sockets before its pidfd reports the exit: give the
      // watch a moment to see it, so the dead leader is named.
      const auto grace = Clock::now() + std::chrono::milliseconds(200);
      while (stillAlive && Clock::now() < grace) {
        stillAlive();
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      throw Error(ErrorCode::kPeerFailure, "create", rank,
                  "the leader closed its connection before handing over the shared segment; "
                  "did it fail?");
    }
    if (Clock::now() >= deadline) {
      throw Error(ErrorCode::kTimeout, "create", rank,
                  "the leader did not hand over the shared segment in time (it may be waiting "
                  "for other ranks, or it failed)");
    }
    stillAlive();
  }
  const auto welcome = handshake::parseWelcome(reply);
  if (welcome && welcome->first == handshake::kAbandoned) {
    throw Error(ErrorCode::kPeerFailure, "create", rank, welcome->second);
  }
  if (!welcome || welcome->first != 0 || !segment) {
    throw Error(ErrorCode::kInternal, "create", rank,
                "the leader refused this rank: " + (welcome ? welcome->second : "bad reply"));
  }
  return {std::move(segment), std::move(socket)};
}

void ProcessService::confirmJoined(const Welcomed& welcomed) {
  const uint8_t joined = 1;
  // A leader that is gone by now learns nothing either way; its members find out from it.
  (void)posix::writeAll(welcomed.leader.get(), &joined, sizeof joined);
}

uint64_t ProcessService::watch(int pid, std::function<void(int)> onExit) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto known = watched_.find(pid);
  if (known == watched_.end()) {
    lock.unlock();
    const int fd = openPidfd(pid);
    const int error = errno;
    posix::Fd pidfd(fd);
    if (!pidfd) {
      // Gone already (a rank that died between joining and being watched): it exited, and
      // nothing else would say so before the operation timeout. Any other failure (no
      // pidfd in this kernel) leaves the timeout to find it.
      if (error == ESRCH) onExit(pid);
      return 0;
    }
    lock.lock();
    known = watched_.find(pid);  // another thread may have opened one meanwhile
    if (known == watched_.end()) {
      known = watched_.emplace(pid, Watched{std::move(pidfd), 0, nextGeneration_++}).first;
    }
  }
  ++known->second.watches;
  const uint64_t id = nextWatch_++;
  watches_[id] = Watch{pid, std::move(onExit)};
  lock.unlock();
  wake();
  return id;
}

void ProcessService::unwatch(uint64_t id) {
  if (id == 0) return;
  std::unique_lock<std::mutex> lock(mutex_);
  if (auto it = watches_.find(id); it != watches_.end()) {
    auto process = watched_.find(it->second.pid);
    if (process != watched_.end() && --process->second.watches == 0) watched_.erase(process);
    watches_.erase(it);
  }
  if (gServiceThread.load() != std::this_thread::get_id()) {
    fired_.wait(lock, [&] { return firing_ != id; });
  }
  lock.unlock();
  wake();
}

}  // namespace loom
