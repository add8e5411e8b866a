#pragma once

// A randomised stream of mixed collectives for stress tests: random kinds, types,
// reductions, sizes and roots, up to four in flight, every result checked against the
// reference. Every rank draws the same sequence from a seeded generator, so all ranks agree
// on what comes next.

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "loom/communicator.h"

namespace loom::testing {

/// Runs `ops` random operations on `comm` from the stream `seed`; returns the first failure
/// ("" when every result was right).
std::string driveRandomCollectives(Communicator& comm, int ops, uint32_t seed);

/// What driveRandomCollectivesUntil did.
struct TimedDrive {
  std::string failure;  ///< "" when every result was right
  long operations = 0;  ///< random operations checked (the agreements not counted)
  int batches = 0;
};

/// Runs batches of `batchOps` random operations (batch b from stream `seed` + b) until a
/// member of `comm` finds `deadline` passed: after each batch the members all_reduce (MAX) a
/// "time is up" flag on `comm`, so all of them stop after the same batch. `afterBatch`, if
/// set, runs after each batch and its agreement with (batches, operations) so far.
TimedDrive driveRandomCollectivesUntil(
    Communicator& comm, std::chrono::steady_clock::time_point deadline, int batchOps, uint32_t seed,
    const std::function<void(int batches, long operations)>& afterBatch = {});

}  // namespace loom::testing
