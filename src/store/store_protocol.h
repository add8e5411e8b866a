#pragma once

// The TcpStore wire format. Every message is a frame: a 4-byte little-endian body length,
// then the body. Request bodies:
//   u8 command | u32 key length | key | command-specific tail
//   SET:   u32 value length | value
//   GET:   u32 timeout in ms
//   ADD:   i64 delta
//   CHECK, ERASE: nothing
// Response bodies: u8 status | payload (GET: the value; ADD: i64; CHECK/ERASE: u8 0 or 1).
// The parser is the only code that reads bytes from the network, so it is written to be
// fuzzed: it never reads past the span and rejects anything it does not fully understand.

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "loom/store.h"

namespace loom::store {

enum class Command : uint8_t { kSet = 1, kGet = 2, kAdd = 3, kCheck = 4, kErase = 5 };
enum class Status : uint8_t { kOk = 0, kTimeout = 1, kBadRequest = 2 };

inline constexpr size_t kMaxKeyBytes = 4096;
inline constexpr size_t kMaxValueBytes = 64u << 20;
inline constexpr size_t kMaxFrameBytes = kMaxValueBytes + kMaxKeyBytes + 64;

/// A decoded request.
struct Request {
  /// A request with only the command and key set.
  static Request of(Command command, std::string key) {
    Request r;
    r.command = command;
    r.key = std::move(key);
    return r;
  }

  Command command = Command::kCheck;
  std::string key;
  Bytes value;             ///< SET
  int64_t delta = 0;       ///< ADD
  uint32_t timeoutMs = 0;  ///< GET
};

/// The frame (length prefix included) for `request`.
Bytes encodeRequest(const Request& request);

/// Decodes one request body (no length prefix). On malformed input returns nullopt and,
/// if `why` is given, says what was wrong.
std::optional<Request> parseRequest(std::span<const uint8_t> body, std::string* why = nullptr);

/// The frame (length prefix included) for a response.
Bytes encodeResponse(Status status, std::span<const uint8_t> payload);

/// Reads the 4-byte length prefix at `p`.
uint32_t readLength(const uint8_t* p);

/// Appends a little-endian i64 (the ADD reply's payload).
void putI64(Bytes& out, int64_t v);
/// Reads the little-endian i64 at `p` (caller checks bounds).
int64_t getI64(const uint8_t* p);

/// The integer held by an ADD counter (decimal text, as c10d stores do), or nullopt.
std::optional<int64_t> parseCounter(const Bytes& bytes);

}  // namespace loom::store
