#pragma once

// The stamp every network message of a collective carries: which call it belongs to and what
// that call was, so that ranks on different hosts that issued different collectives (another
// operation, type, reduction, root or count) fail with a named mismatch instead of exchanging
// bytes that do not fit, and a message left over from an earlier call is never taken for the
// current one's. Within a host the shared-memory descriptors check the same fields
// (context.cc); across hosts this is the only check, and it costs no extra message.
//
// Layout (64 bits): the call's sequence number mod 2^32 (bits 0-31), its CollectiveKind
// (32-35), DataType (36-39) and ReduceKind (40-43), and 20 bits of a hash of the rest that
// must agree (count, root, per-rank counts, PREMUL_SUM factor, the caller's signature).

#include <cstdint>
#include <string>

#include "algorithms/collective.h"

namespace loom {

/// The stamp of call `seq` of the communicator with these arguments (never 0: 0 marks
/// messages outside collectives).
uint64_t callStamp(const CollectiveArgs& args, uint64_t seq);

/// Why a message stamped `theirs` from `peer` (described as such) does not belong to this
/// rank's call, stamped `mine` with sequence number `seq`: which collective each is, as far as
/// the stamps tell.
std::string explainStamps(uint64_t theirs, uint64_t mine, uint64_t seq, const std::string& peer);

}  // namespace loom
