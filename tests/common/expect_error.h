#pragma once

// Checks, inside a forked rank, that a call throws loom::Error with the expected code and
// message parts (failures go through LOOM_CHECK, so they fail the rank).

#include <initializer_list>
#include <string>
#include <string_view>

#include "forked_ranks.h"
#include "loom/error.h"

namespace loom::testing {

/// Runs `call`, expecting Error with `code` whose message contains every one of `parts`.
template <class F>
void expectError(F&& call, ErrorCode code, std::initializer_list<const char*> parts) {
  try {
    call();
  } catch (const Error& e) {
    LOOM_CHECK(e.code() == code, << "wrong code (" << errorCodeName(e.code()) << "): " << e.what());
    for (const char* part : parts) {
      LOOM_CHECK(std::string(e.what()).find(part) != std::string::npos,
                 << "message lacks '" << part << "': " << e.what());
    }
    return;
  }
  LOOM_CHECK(false, << "expected an error containing '" << *parts.begin() << "'");
}

/// Runs `call`, expecting Error(kInvalidArgument) from operation `op` on rank `rank` whose
/// message contains every one of `parts` (the argument's name, its value, ...).
template <class F>
void expectInvalid(F&& call, std::string_view op, int rank,
                   std::initializer_list<const char*> parts) {
  try {
    call();
  } catch (const Error& e) {
    LOOM_CHECK(e.code() == ErrorCode::kInvalidArgument,
               << "wrong code (" << errorCodeName(e.code()) << "): " << e.what());
    LOOM_CHECK(e.op() == op, << "wrong op '" << e.op() << "' (want '" << op << "'): " << e.what());
    LOOM_CHECK(e.rank() == rank, << "wrong rank " << e.rank() << " (want " << rank << ")");
    const std::string prefix =
        "loom " + std::string(op) + (rank >= 0 ? " (rank " + std::to_string(rank) + ")" : "");
    LOOM_CHECK(std::string(e.what()).find(prefix) != std::string::npos,
               << "message lacks '" << prefix << "': " << e.what());
    for (const char* part : parts) {
      LOOM_CHECK(std::string(e.what()).find(part) != std::string::npos,
                 << "message lacks '" << part << "': " << e.what());
    }
    return;
  }
  LOOM_CHECK(false, << "expected " << op << " to refuse its arguments ('"
                    << (parts.size() ? *parts.begin() : "") << "')");
}

}  // namespace loom::testing
