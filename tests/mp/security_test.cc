// Who can join a job and reach its memory: other users, same-user strangers, malformed Hellos,
// /proc and ptrace, nothing on the filesystem (docs/SECURITY.md lists what each test proves).

#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "../common/forked_ranks.h"
#include "../common/process_stats.h"
#include "core/bootstrap.h"
#include "core/handshake.h"
#include "core/process_service.h"
#include "loom/error.h"
#include "transport/shm/segment.h"
#include "util/comm_id.h"
#include "util/posix.h"
#include "util/unix_socket.h"

namespace loom {
namespace {

using testing::RankContext;
using Clock = std::chrono::steady_clock;

constexpr uid_t kNobody = 65534;  // the conventional 'nobody' user and group

void checkAllReduce(Communicator& comm) {
  std::vector<float> x(4096, static_cast<float>(comm.rank() + 1));
  comm.allReduce(x.data(), x.data(), x.size(), DataType::kFloat32, ReduceKind::kSum).wait();
  const float want = static_cast<float>(comm.size() * (comm.size() + 1) / 2);
  for (float v : x) LOOM_CHECK(v == want, << "all_reduce gave " << v << ", want " << want);
}

// The roster rank 0 published for the first communicator of this job: what anyone who can
// read the store learns (id, job secret, every rank's socket).
Roster readRoster(const RankContext& ctx) {
  const Bytes bytes = ctx.store->get("loom/1/roster", std::chrono::seconds(30));
  auto roster = parseRoster(bytes, ctx.size);
  LOOM_CHECK(roster.has_value(), << "could not parse the roster in the store");
  return std::move(*roster);
}

Bytes helloBytes(const CommId& comm, const handshake::Secret& secret, int rank) {
  handshake::Hello hello;
  hello.comm = comm;
  hello.secret = secret;
  hello.rank = rank;
  hello.pid = static_cast<int32_t>(::getpid());
  const auto bytes = handshake::encodeHello(hello);
  return Bytes(bytes.begin(), bytes.end());
}

// Runs `body` in a forked child and returns its exit code (a failed child says why on stderr,
// which is the rank's output). With `asNobody` the child first becomes uid/gid 65534.
int runInChild(bool asNobody, const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int code = 0;
    if (asNobody && (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 ||
                     ::setuid(kNobody) != 0 || ::geteuid() != kNobody)) {
      std::cerr << "could not become uid " << kNobody << ": " << std::strerror(errno) << std::endl;
      code = 100;
    } else {
      try {
        code = body();
      } catch (const std::exception& e) {
        std::cerr << "child: " << e.what() << std::endl;
        code = 101;
      }
    }
    std::cerr.flush();
    ::_exit(code);
  }
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid) return 102;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// What a connection to a process service gave back.
struct Exchange {
  bool connected = false;
  std::vector<uint8_t> received;  ///< every byte the service sent
  bool gotFd = false;             ///< a descriptor came with them
  bool ended = false;             ///< the service closed the connection (EOF or reset)
};

// Connects to `address`, sends `bytes` (then half-closes if `finish`), and reads until the
// service closes the connection or `patience` runs out.
Exchange talk(const std::string& address, const Bytes& bytes, bool finish,
              std::chrono::seconds patience = std::chrono::seconds(60)) {
  Exchange out;
  posix::Fd socket = unix_socket::connectAbstract(address);
  if (!socket) return out;
  out.connected = true;
  // The service may already have dropped us: a failed send is part of being refused.
  [[maybe_unused]] ssize_t sent = ::send(socket.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
  if (finish) ::shutdown(socket.get(), SHUT_WR);
  const auto deadline = Clock::now() + patience;
  while (Clock::now() < deadline) {
    pollfd pfd{socket.get(), POLLIN, 0};
    if (::poll(&pfd, 1, 1000) <= 0) continue;
    uint8_t buffer[512];
    posix::Fd fd;  // closed again at once: only whether one came matters
    const ssize_t k = unix_socket::recvSome(socket.get(), buffer, sizeof buffer, &fd);
    if (k < 0 && errno == EAGAIN) continue;
    if (fd) out.gotFd = true;
    if (k <= 0) {
      out.ended = k == 0 || errno == ECONNRESET;
      break;
    }
    out.received.insert(out.received.end(), buffer, buffer + k);
  }
  return out;
}

// 0 if the service closed the connection without sending a byte or a descriptor.
int expectDroppedSilently(const char* what, const Exchange& e) {
  if (e.connected && e.received.empty() && !e.gotFd && e.ended) return 0;
  std::cerr << what << ": connected " << e.connected << ", received " << e.received.size()
            << " bytes, fd " << e.gotFd << ", closed " << e.ended << std::endl;
  return 1;
}

// 0 if the service answered with a refusal (a Welcome with a non-zero status), no descriptor,
// and closed the connection.
int expectRefused(const char* what, const Exchange& e) {
  const auto welcome = handshake::parseWelcome(e.received);
  if (e.connected && welcome && welcome->first != 0 && !e.gotFd && e.ended) {
    std::cout << what << ": refused (" << welcome->second << ")" << std::endl;
    return 0;
  }
  std::cerr << what << ": connected " << e.connected << ", received " << e.received.size()
            << " bytes" << (welcome ? " (status " + std::to_string(welcome->first) + ")" : "")
            << ", fd " << e.gotFd << ", closed " << e.ended << std::endl;
  return 1;
}

// This process's descriptor of a loom segment, and the address range of its first mapping.
int loomSegmentFd() {
  for (int fd = 0; fd < 4096; ++fd) {
    char target[256] = {};
    const std::string link = "/proc/self/fd/" + std::to_string(fd);
    if (::readlink(link.c_str(), target, sizeof target - 1) <= 0) continue;
    if (std::string(target) == "/memfd:loom (deleted)") return fd;
  }
  return -1;
}

std::string loomMappingRange() {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/memfd:loom (deleted)") != std::string::npos) {
      return line.substr(0, line.find(' '));
    }
  }
  return "";
}

bool deniedErrno(int e) {
  return e == EACCES || e == EPERM;
}

#define SKIP_UNLESS_ROOT()                                                                 \
  if (::geteuid() != 0) {                                                                  \
    GTEST_SKIP() << "needs root, to run a process as another user (uid " << kNobody        \
                 << "); run the suite as root (as CI does) to check cross-user isolation"; \
  }

// A process of another user that knows everything in the store (communicator id, job secret,
// the leader's socket) is dropped before the service reads its Hello: it gets no byte and no
// descriptor, and cannot take a rank of a communicator about to be created. The job goes on.
TEST(Security, OtherUserIsDroppedEvenWithTheJobSecret) {
  SKIP_UNLESS_ROOT();
  testing::expectAllSucceeded(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    checkAllReduce(*comm);
    // The id the split below will use (Communicator::split's salt, then the member list): a
    // Hello for it that got past the uid check would be parked and take rank 1's place.
    CommId childId{};
    if (ctx.rank == 0) {
      const Roster roster = readRoster(ctx);
      childId = deriveId(roster.id, "split/0/0/0,1,");
      const std::string address = roster.peers[0].address;
      LOOM_CHECK(address == ProcessService::instance().address());
      const Bytes forChild = helloBytes(childId, roster.secret, 1);
      const Bytes forParent = helloBytes(roster.id, roster.secret, 1);
      const int code = runInChild(true, [&] {
        return expectDroppedSilently("hello for the next communicator",
                                     talk(address, forChild, false)) +
               expectDroppedSilently("hello for the live communicator",
                                     talk(address, forParent, false)) +
               expectDroppedSilently("garbage", talk(address, Bytes(48, 0xab), false));
      });
      LOOM_CHECK(
          code == 0, << "the other user's process was not dropped silently (" << code << ")");
    }
    auto child = comm->split(0, ctx.rank);
    LOOM_CHECK(child != nullptr);
    if (ctx.rank == 0) {
      LOOM_CHECK(shm::Segment::findMapped(childId) != nullptr,
                 << "the test aimed at the wrong communicator id");
    }
    checkAllReduce(*child);
    checkAllReduce(*comm);
  });
}

// Another user cannot reach a rank's segment through /proc (its descriptor, its mapping, its
// memory) nor attach with ptrace, while the rank itself (root) can open the same paths.
TEST(Security, OtherUserCannotOpenTheSegmentOrTraceARank) {
  SKIP_UNLESS_ROOT();
  testing::expectAllSucceeded(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    checkAllReduce(*comm);
    const pid_t pid = ::getpid();
    const int fd = loomSegmentFd();
    const std::string range = loomMappingRange();
    LOOM_CHECK(fd >= 0 && !range.empty(), << "no loom segment in this rank");
    const std::string proc = "/proc/" + std::to_string(pid);
    const std::vector<std::string> paths = {proc + "/fd/" + std::to_string(fd),
                                            proc + "/map_files/" + range, proc + "/mem"};
    // The paths are right: the owner opens every one of them.
    for (const std::string& path : paths) {
      posix::Fd mine(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
      LOOM_CHECK(mine, << "the rank itself cannot open " << path << ": " << std::strerror(errno));
    }
    const uintptr_t start = std::stoull(range.substr(0, range.find('-')), nullptr, 16);
    const int code = runInChild(true, [&] {
      int failures = 0;
      for (const std::string& path : paths) {
        for (int flags : {O_RDONLY, O_RDWR}) {
          const int opened = ::open(path.c_str(), flags | O_CLOEXEC);
          if (opened >= 0 || !deniedErrno(errno)) {
            std::cerr << "uid " << ::geteuid() << " opened " << path << " (flags " << flags
                      << "): " << (opened >= 0 ? "success" : std::strerror(errno)) << std::endl;
            ++failures;
          }
          if (opened >= 0) ::close(opened);
        }
      }
      char target[256];
      if (::readlink(paths[0].c_str(), target, sizeof target) >= 0 || !deniedErrno(errno)) {
        std::cerr << "readlink " << paths[0] << " was not denied" << std::endl;
        ++failures;
      }
      uint64_t word = 0;
      iovec local{&word, sizeof word};
      iovec remote{reinterpret_cast<void*>(start), sizeof word};
      if (::process_vm_readv(pid, &local, 1, &remote, 1, 0) >= 0 || errno != EPERM) {
        std::cerr << "process_vm_readv was not denied: " << std::strerror(errno) << std::endl;
        ++failures;
      }
      if (::ptrace(PTRACE_SEIZE, pid, nullptr, nullptr) == 0 || errno != EPERM) {
        std::cerr << "ptrace(PTRACE_SEIZE) was not denied: " << std::strerror(errno) << std::endl;
        ++failures;
      }
      return failures;
    });
    LOOM_CHECK(code == 0, << code << " way(s) into rank " << ctx.rank << " were not denied");
    checkAllReduce(*comm);
  });
}

// A process of our own user that is not in the job is refused whatever it sends (a wrong
// secret, a rank already taken or out of range, garbage, a truncated Hello, a Hello for an
// unknown communicator), leaves no descriptor behind in the leader, and the job goes on.
TEST(Security, SameUserStrangerIsRefusedWithoutHarm) {
  testing::expectAllSucceeded(2, [](RankContext& ctx) {
    auto comm = ctx.connect();
    checkAllReduce(*comm);
    comm->barrier().wait();
    const testing::ProcessStats before = testing::sampleProcess();
    const std::string fdsBefore = testing::describeFds();
    comm->barrier().wait();  // rank 1 sends the strangers now
    if (ctx.rank == 1) {
      const Roster roster = readRoster(ctx);
      const std::string address = roster.peers[0].address;
      handshake::Secret wrong = roster.secret;
      wrong[3] ^= 0x10;
      CommId unknown{};
      posix::randomBytes(unknown.data(), unknown.size());
      const Bytes valid = helloBytes(roster.id, roster.secret, 1);
      const Bytes truncated(valid.begin(), valid.begin() + 20);
      struct Case {
        const char* what;
        Bytes bytes;
        bool finish;   // half-close after sending
        bool refused;  // answered with a refusal (else dropped without a word)
      };
      const std::vector<Case> cases = {
          {"wrong secret", helloBytes(roster.id, wrong, 1), false, true},
          {"rank already taken", valid, false, true},
          {"rank out of range", helloBytes(roster.id, roster.secret, 9), false, true},
          {"rank 0", helloBytes(roster.id, roster.secret, 0), false, true},
          {"garbage", Bytes(handshake::kHelloBytes, 0x5a), false, false},
          {"oversized garbage", Bytes(1 << 16, 0x5a), false, false},
          {"truncated hello, then hang-up", truncated, true, false},
          {"truncated hello, held open", truncated, false, false},
          {"unknown communicator, then hang-up", helloBytes(unknown, roster.secret, 1), true,
           false},
      };
      for (const Case& c : cases) {
        const int code = runInChild(false, [&] {
          const Exchange e = talk(address, c.bytes, c.finish);
          return c.refused ? expectRefused(c.what, e) : expectDroppedSilently(c.what, e);
        });
        LOOM_CHECK(code == 0, << "stranger '" << c.what << "' was not turned away");
      }
    }
    comm->barrier().wait();
    checkAllReduce(*comm);
    if (ctx.rank == 0) {
      const testing::ProcessStats after = testing::sampleProcess();
      LOOM_CHECK(after.fds == before.fds, << "the leader's descriptors went from "
                                          << testing::describe(before) << " to "
                                          << testing::describe(after) << "\nfds before:\n"
                                          << fdsBefore << "fds after:\n"
                                          << testing::describeFds());
    }
    // Rank 1 starts the next strangers only once the leader has counted: a Hello it sends
    // for the next communicator waits, parked, in the leader's service until that one is
    // made, and would be counted here.
    comm->barrier().wait();
    // A wrong secret for a communicator still being made: refused by the leader whether it
    // arrives before the leader asks, while it accepts, or after.
    CommId childId{};
    int code = 0;
    pid_t stranger = -1;
    if (ctx.rank == 1) {
      const Roster roster = readRoster(ctx);
      handshake::Secret wrong = roster.secret;
      wrong[0] ^= 1;
      childId = deriveId(roster.id, "split/0/0/0,1,");
      const Bytes hello = helloBytes(childId, wrong, 1);
      const std::string address = roster.peers[0].address;
      stranger = ::fork();
      if (stranger == 0) {
        ::_exit(expectRefused("wrong secret for a new communicator", talk(address, hello, false)));
      }
    }
    auto child = comm->split(0, ctx.rank);
    LOOM_CHECK(child != nullptr);
    checkAllReduce(*child);
    if (ctx.rank == 1) {
      LOOM_CHECK(shm::Segment::findMapped(childId) != nullptr);
      int status = 0;
      LOOM_CHECK(::waitpid(stranger, &status, 0) == stranger);
      code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      LOOM_CHECK(code == 0, << "the stranger with a wrong secret was not refused");
    }
    checkAllReduce(*comm);
  });
}

// Nothing of loom's appears in /dev/shm; the segment is an unlinked, owner-only, sealed memfd
// and the process service's socket is abstract (no file anywhere).
TEST(Security, NothingOnTheFilesystemAndTheSegmentIsOwnerOnly) {
  const testing::SharedMemoryFootprint before = testing::sharedMemoryFootprint();
  testing::expectAllSucceeded(3, [](RankContext& ctx) {
    auto comm = ctx.connect();
    checkAllReduce(*comm);
    const int fd = loomSegmentFd();
    LOOM_CHECK(fd >= 0);
    struct stat st {};
    LOOM_CHECK(::fstat(fd, &st) == 0);
    LOOM_CHECK((st.st_mode & 07777) == 0600,
               << "segment mode " << std::oct << (st.st_mode & 07777));
    LOOM_CHECK(st.st_uid == ::geteuid());
    LOOM_CHECK(st.st_nlink == 0, << "the segment has a name on some filesystem");
    const int seals = ::fcntl(fd, F_GET_SEALS);
    const int want = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
    LOOM_CHECK(seals >= 0 && (seals & want) == want, << "seals " << seals);
    const std::string address = ProcessService::instance().address();
    LOOM_CHECK(address.rfind("loom." + std::to_string(::geteuid()) + ".", 0) == 0);
    bool abstract = false;
    std::ifstream sockets("/proc/net/unix");
    for (std::string line; std::getline(sockets, line);) {
      if (line.size() > address.size() &&
          line.compare(line.size() - address.size() - 1, std::string::npos, "@" + address) == 0) {
        abstract = true;
      }
    }
    LOOM_CHECK(abstract, << "socket '" << address << "' is not in the abstract namespace");
  });
  const testing::SharedMemoryFootprint after = testing::sharedMemoryFootprint();
  EXPECT_EQ(after, before) << "before: " << testing::describe(before)
                           << "; after: " << testing::describe(after);
}

// A member talks only to a leader of its own user: if the store names another user's socket,
// the member refuses before sending its Hello (so it never maps memory that user controls).
TEST(Security, MemberRefusesALeaderOfAnotherUser) {
  SKIP_UNLESS_ROOT();
  testing::expectAllSucceeded(1, [](RankContext&) {
    uint8_t random[8];
    posix::randomBytes(random, sizeof random);
    std::string name = "loom-security-test." + std::to_string(::getpid()) + ".";
    for (uint8_t b : random) name += std::to_string(b);
    int ready[2];
    LOOM_CHECK(::pipe(ready) == 0);
    const pid_t impostor = ::fork();
    if (impostor == 0) {
      int code = 0;
      try {
        if (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 || ::setuid(kNobody) != 0) {
          code = 100;
        } else {
          posix::Fd listener = unix_socket::listenAbstract(name);
          [[maybe_unused]] ssize_t k = ::write(ready[1], "r", 1);
          pollfd pfd{listener.get(), POLLIN, 0};
          posix::Fd conn;
          if (::poll(&pfd, 1, 60000) == 1) {
            conn = posix::Fd(::accept(listener.get(), nullptr, nullptr));
          }
          // The member hung up without a word: no Hello, no secret.
          uint8_t byte;
          code = !conn ? 2 : ::read(conn.get(), &byte, 1) == 0 ? 0 : 3;
        }
      } catch (...) {
        code = 101;
      }
      ::_exit(code);
    }
    ::close(ready[1]);
    char r;
    LOOM_CHECK(::read(ready[0], &r, 1) == 1, << "the impostor did not start");
    ::close(ready[0]);
    handshake::Hello hello;
    posix::randomBytes(hello.comm.data(), hello.comm.size());
    posix::randomBytes(hello.secret.data(), hello.secret.size());
    hello.rank = 1;
    hello.pid = static_cast<int32_t>(::getpid());
    bool refused = false;
    try {
      ProcessService::instance().joinLeader(name, hello, 1,
                                            Clock::now() + std::chrono::seconds(30));
    } catch (const Error& e) {
      refused = e.code() == ErrorCode::kPeerFailure &&
                std::string(e.what()).find("uid " + std::to_string(kNobody)) != std::string::npos;
      LOOM_CHECK(refused, << "unexpected error: " << e.what());
    }
    LOOM_CHECK(refused, << "the member joined a leader of another user");
    int status = 0;
    LOOM_CHECK(::waitpid(impostor, &status, 0) == impostor);
    LOOM_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
               << "the impostor received bytes or failed (status " << status << ")");
  });
}

}  // namespace
}  // namespace loom
