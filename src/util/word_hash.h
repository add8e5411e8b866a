#pragma once

// A hash of a few 64-bit words, a word at a time: what the shared-memory descriptor's
// fingerprint (algorithms/context.cc) and a network message's call stamp
// (algorithms/call_stamp.cc) fold the fields that must agree into. Each word costs a multiply
// and a shift; equal inputs always hash alike, unequal ones collide with a chance near 2^-64.

#include <cstdint>

namespace loom {

class WordHash {
 public:
  /// Folds `word` in.
  void mix(uint64_t word) {
    h_ = (h_ ^ word) * 0x9e3779b97f4a7c15ULL;
    h_ ^= h_ >> 29;
  }
  /// The hash of what was folded in, mixed once more.
  uint64_t value() const {
    const uint64_t h = h_ * 0xbf58476d1ce4e5b9ULL;
    return h ^ (h >> 31);
  }

 private:
  uint64_t h_ = 0x6a09e667f3bcc909ULL;
};

}  // namespace loom
