// Forking ranks, collecting their output, and killing stragglers.

#include "forked_ranks.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <thread>

#include "loom/error.h"
#include "loom/tcp_store.h"

namespace loom::testing {

namespace {

std::string readAll(int fd) {
  std::string out;
  char buffer[4096];
  ::lseek(fd, 0, SEEK_SET);
  ssize_t k;
  while ((k = ::read(fd, buffer, sizeof buffer)) > 0) out.append(buffer, static_cast<size_t>(k));
  return out;
}

[[noreturn]] void runChild(int rank, int size, uint16_t port, int outputFd,
                           const std::function<void(RankContext&)>& body,
                           const RunOptions& options) {
  ::dup2(outputFd, STDOUT_FILENO);
  ::dup2(outputFd, STDERR_FILENO);
  int code = 0;
  try {
    for (const std::string& assignment : options.environment) {
      const size_t eq = assignment.find('=');
      ::setenv(assignment.substr(0, eq).c_str(), assignment.substr(eq + 1).c_str(), 1);
    }
    RankContext ctx;
    ctx.rank = rank;
    ctx.size = size;
    ctx.store = std::make_shared<TcpStore>("127.0.0.1", port, std::chrono::seconds(30));
    body(ctx);
  } catch (const std::exception& e) {
    std::cerr << "rank " << rank << ": " << e.what() << std::endl;
    code = 1;
  } catch (...) {
    std::cerr << "rank " << rank << ": unknown exception" << std::endl;
    code = 1;
  }
  std::cout.flush();
  std::cerr.flush();
  // _exit: no static destructors or atexit handlers of the parent's test framework.
  ::_exit(code);
}

}  // namespace

std::vector<RankOutcome> runRanks(int size, const std::function<void(RankContext&)>& body,
                                  const RunOptions& options) {
  TcpStoreServer server("127.0.0.1", 0);
  std::vector<pid_t> pids(static_cast<size_t>(size), -1);
  std::vector<int> outputs(static_cast<size_t>(size), -1);
  std::cout.flush();
  std::cerr.flush();
  for (int r = 0; r < size; ++r) {
    outputs[r] = ::memfd_create("loom-test-output", MFD_CLOEXEC);
    const pid_t pid = ::fork();
    if (pid == 0) {
      server.closeInChild();
      runChild(r, size, server.port(), outputs[r], body, options);
    }
    pids[r] = pid;
  }
  server.start();

  std::vector<RankOutcome> outcomes(static_cast<size_t>(size));
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  int remaining = size;
  bool killed = false;
  while (remaining > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (int r = 0; r < size; ++r) {
        if (pids[r] != pid) continue;
        outcomes[r].rank = r;
        outcomes[r].exited = WIFEXITED(status);
        outcomes[r].status = WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status);
        --remaining;
      }
      continue;
    }
    if (!killed && std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < size; ++r) ::kill(pids[r], SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (int r = 0; r < size; ++r) {
    outcomes[r].output = readAll(outputs[r]);
    if (killed && !outcomes[r].exited) outcomes[r].output += "\n[killed at the test deadline]";
    ::close(outputs[r]);
  }
  return outcomes;
}

std::string failures(const std::vector<RankOutcome>& outcomes) {
  std::string report;
  for (const RankOutcome& o : outcomes) {
    if (o.exited && o.status == 0) continue;
    report += "rank " + std::to_string(o.rank) +
              (o.exited ? " exited with " + std::to_string(o.status)
                        : " was killed by signal " + std::to_string(o.status)) +
              ":\n" + o.output + "\n";
  }
  return report;
}

void expectAllSucceeded(int size, const std::function<void(RankContext&)>& body,
                        const RunOptions& options) {
  const std::string report = failures(runRanks(size, body, options));
  EXPECT_TRUE(report.empty()) << report;
}

}  // namespace loom::testing
