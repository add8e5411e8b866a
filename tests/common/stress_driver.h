#pragma once

// A randomised stream of mixed collectives for stress tests: random kinds, types,
// reductions, sizes and roots, up to four in flight, every result checked against the
// reference. Every rank draws the same sequence from a seeded generator, so all ranks agree
// on what comes next.

#include <cstdint>
#include <string>

#include "loom/communicator.h"

namespace loom::testing {

/// Runs `ops` random operations on `comm` from the stream `seed`; returns the first failure
/// ("" when every result was right).
std::string driveRandomCollectives(Communicator& comm, int ops, uint32_t seed);

}  // namespace loom::testing
