// Fuzzes the TcpStore request parser, the only code that reads bytes a store client sends:
// it must never read out of bounds, must say why it refuses, and whatever it accepts must
// survive an encode/parse round trip unchanged. Also feeds the bytes to parseCounter.

#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>

#include "store/store_protocol.h"

namespace {

using loom::store::Request;

bool same(const Request& a, const Request& b) {
  return a.command == b.command && a.key == b.key && a.value == b.value && a.delta == b.delta &&
         a.timeoutMs == b.timeoutMs;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> body(data, size);
  std::string why;
  const auto request = loom::store::parseRequest(body, &why);
  if (!request) {
    if (why.empty()) std::abort();  // a refusal always names its reason
  } else {
    const loom::Bytes frame = loom::store::encodeRequest(*request);
    if (frame.size() < 4 || loom::store::readLength(frame.data()) != frame.size() - 4) std::abort();
    const auto again = loom::store::parseRequest(std::span<const uint8_t>(frame).subspan(4));
    if (!again || !same(*again, *request)) std::abort();
  }
  (void)loom::store::parseCounter(loom::Bytes(data, data + size));
  return 0;
}
