#pragma once

// Runs a test body as real ranks: `size` forked processes that meet through a TcpStore served
// by the test process. Checks inside a rank use LOOM_CHECK (throws); a rank that throws,
// crashes or exits non-zero fails the test with that rank's output attached, and ranks still
// running at the deadline are killed (a hang becomes a failure, never a stuck CI job).

#include <chrono>
#include <functional>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "loom/communicator.h"
#include "loom/store.h"

namespace loom::testing {

/// What a rank's body gets.
struct RankContext {
  int rank = 0;
  int size = 0;
  std::shared_ptr<Store> store;
  /// Joins the communicator of this job (the options may name, time out, ...).
  std::shared_ptr<Communicator> connect(const CommOptions& options = {}) const {
    return Communicator::create(rank, size, store, options);
  }
};

/// How each rank ended.
struct RankOutcome {
  int rank = 0;
  bool exited = false;  ///< false: killed by a signal
  int status = 0;       ///< exit code, or the signal number
  std::string output;   ///< what it wrote to stdout and stderr
};

/// Options for runRanks.
struct RunOptions {
  std::chrono::seconds timeout{180};
  /// Environment variables set in every rank before the body runs (NAME=value).
  std::vector<std::string> environment;
};

/// Runs `body` on `size` ranks and returns their outcomes (rank order). Never throws for a
/// failing rank: use expectAllSucceeded or inspect the outcomes (fault-injection tests).
std::vector<RankOutcome> runRanks(int size, const std::function<void(RankContext&)>& body,
                                  const RunOptions& options = {});

/// Empty if every rank exited 0, else a report of each rank that did not.
std::string failures(const std::vector<RankOutcome>& outcomes);

/// Runs `body` on `size` ranks; fails the calling test (a gtest expectation) with the report
/// of every rank that did not exit 0.
void expectAllSucceeded(int size, const std::function<void(RankContext&)>& body,
                        const RunOptions& options = {});

/// Thrown by LOOM_CHECK inside a rank.
struct CheckFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace loom::testing

/// Fails the current rank (not the test process) with a message if `cond` is false.
#define LOOM_CHECK(cond, ...)                                                                   \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      std::ostringstream loom_check_os;                                                         \
      loom_check_os << __FILE__ << ":" << __LINE__ << ": check failed: " #cond " " __VA_ARGS__; \
      throw ::loom::testing::CheckFailure(loom_check_os.str());                                 \
    }                                                                                           \
  } while (0)

/// Runs the body on `size` ranks and fails the gtest test if any rank failed.
#define LOOM_RUN_RANKS(size, ...)                                              \
  do {                                                                         \
    const auto loom_outcomes = ::loom::testing::runRanks((size), __VA_ARGS__); \
    const std::string loom_report = ::loom::testing::failures(loom_outcomes);  \
    EXPECT_TRUE(loom_report.empty()) << loom_report;                           \
  } while (0)
