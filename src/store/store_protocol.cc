// Encoding and bounds-checked decoding of TcpStore messages.

#include "store/store_protocol.h"

#include <charconv>

#include "util/bytes.h"

namespace loom::store {

namespace {

Bytes frame(ByteWriter& body) {
  ByteWriter out;
  out.integer<uint32_t>(static_cast<uint32_t>(body.bytes().size()));
  out.raw(body.bytes().data(), body.bytes().size());
  return std::move(out.bytes());
}

std::optional<Request> fail(std::string* why, const char* what) {
  if (why != nullptr) *why = what;
  return std::nullopt;
}

}  // namespace

uint32_t readLength(const uint8_t* p) {
  uint32_t v = 0;
  ByteReader(std::span<const uint8_t>(p, 4)).integer(&v);
  return v;
}

int64_t getI64(const uint8_t* p) {
  int64_t v = 0;
  ByteReader(std::span<const uint8_t>(p, 8)).integer(&v);
  return v;
}

void putI64(Bytes& out, int64_t v) {
  ByteWriter w;
  w.integer(v);
  out.insert(out.end(), w.bytes().begin(), w.bytes().end());
}

Bytes encodeRequest(const Request& request) {
  ByteWriter body;
  body.integer(static_cast<uint8_t>(request.command));
  body.string(request.key);
  switch (request.command) {
    case Command::kSet:
      body.integer<uint32_t>(static_cast<uint32_t>(request.value.size()));
      body.raw(request.value.data(), request.value.size());
      break;
    case Command::kGet: body.integer(request.timeoutMs); break;
    case Command::kAdd: body.integer(request.delta); break;
    case Command::kCheck:
    case Command::kErase: break;
  }
  return frame(body);
}

std::optional<Request> parseRequest(std::span<const uint8_t> body, std::string* why) {
  ByteReader in(body);
  Request request;
  uint8_t command = 0;
  if (!in.integer(&command)) return fail(why, "empty request");
  if (command < static_cast<uint8_t>(Command::kSet) ||
      command > static_cast<uint8_t>(Command::kErase)) {
    return fail(why, "unknown command");
  }
  request.command = static_cast<Command>(command);
  if (!in.string(&request.key, kMaxKeyBytes)) return fail(why, "bad or oversized key");
  if (request.key.empty()) return fail(why, "empty key");
  switch (request.command) {
    case Command::kSet: {
      uint32_t length = 0;
      std::span<const uint8_t> value;
      if (!in.integer(&length)) return fail(why, "truncated value length");
      if (length > kMaxValueBytes) return fail(why, "value too large");
      if (!in.view(length, &value)) return fail(why, "truncated value");
      request.value.assign(value.begin(), value.end());
      break;
    }
    case Command::kGet:
      if (!in.integer(&request.timeoutMs)) return fail(why, "truncated timeout");
      break;
    case Command::kAdd:
      if (!in.integer(&request.delta)) return fail(why, "truncated delta");
      break;
    case Command::kCheck:
    case Command::kErase: break;
  }
  if (!in.atEnd()) return fail(why, "trailing bytes");
  return request;
}

Bytes encodeResponse(Status status, std::span<const uint8_t> payload) {
  ByteWriter body;
  body.integer(static_cast<uint8_t>(status));
  body.raw(payload.data(), payload.size());
  return frame(body);
}

std::optional<int64_t> parseCounter(const Bytes& bytes) {
  if (bytes.empty()) return int64_t{0};
  int64_t value = 0;
  const char* begin = reinterpret_cast<const char*>(bytes.data());
  const char* end = begin + bytes.size();
  auto [ptr, ec] = std::from_chars(begin, end, value);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

}  // namespace loom::store
