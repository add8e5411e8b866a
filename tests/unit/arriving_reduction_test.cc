// A block reduced as its bytes arrive in pieces of any size and alignment
// (algorithms/arriving_reduction.h): the result, and every prefix it calls final, equal the
// whole block's reduction; aligned whole elements are reduced where they lie.

#include "algorithms/arriving_reduction.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace loom {
namespace {

// Elementwise wrapping sum of unsigned integers `es` bytes wide.
void addElements(void* dst, const void* src, size_t count, size_t es) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  for (size_t i = 0; i < count; ++i) {
    uint64_t a = 0, b = 0;
    std::memcpy(&a, d + i * es, es);
    std::memcpy(&b, s + i * es, es);
    a += b;
    std::memcpy(d + i * es, &a, es);
  }
}

struct Arrival {
  size_t bytes = 0;
  bool throughWaiting = false;  // the caller copies it into `waiting` itself (a plain read)
  size_t misalign = 0;          // where in its own memory the piece lies, past an aligned start
};

// Feeds `block` (own values `mine`, arriving values `theirs`) in the given pieces and checks
// every prefix called final, then the whole.
void feed(size_t es, const std::vector<Arrival>& pieces, size_t minPart, const std::string& what) {
  size_t bytes = 0;
  for (const Arrival& a : pieces) bytes += a.bytes;
  ASSERT_EQ(bytes % es, 0U) << what;
  std::mt19937 random(static_cast<uint32_t>(bytes * 31 + es));
  std::vector<uint8_t> mine(bytes), theirs(bytes), expected(bytes);
  for (auto& b : mine) b = static_cast<uint8_t>(random());
  for (auto& b : theirs) b = static_cast<uint8_t>(random());
  expected = mine;
  addElements(expected.data(), theirs.data(), bytes / es, es);

  std::vector<uint8_t> into = mine, waiting(bytes, 0xEE);
  const uint8_t* pieceBegin = nullptr;
  const uint8_t* pieceEnd = nullptr;
  size_t reducedInPlace = 0;  // bytes reduced straight from a piece's own memory
  ArrivingReduction reduction(into.data(), waiting.data(), bytes, es, minPart,
                              [&](void* dst, const void* src, size_t count) {
                                const auto* at = static_cast<const uint8_t*>(src);
                                if (at >= pieceBegin && at < pieceEnd) reducedInPlace += count * es;
                                addElements(dst, src, count, es);
                              });
  size_t at = 0, final = 0;
  for (const Arrival& a : pieces) {
    // The piece in memory of its own, `misalign` bytes past a 64-byte boundary.
    std::vector<uint8_t> memory(a.bytes + 128);
    uint8_t* base =
        memory.data() + (64 - reinterpret_cast<uintptr_t>(memory.data()) % 64) + a.misalign;
    std::memcpy(base, theirs.data() + at, a.bytes);
    pieceBegin = base;
    pieceEnd = base + a.bytes;
    if (a.throughWaiting) {
      std::memcpy(waiting.data() + at, base, a.bytes);
    } else {
      reduction.take(at, {base, a.bytes});
    }
    std::memset(base, 0xAB, a.bytes);  // the link reuses its memory at once
    at += a.bytes;
    const size_t now = reduction.landed(at);
    ASSERT_GE(now, final) << what << ": the final prefix shrank at byte " << at;
    ASSERT_LE(now, at) << what;
    ASSERT_EQ(now % es, 0U) << what << ": a final prefix ends inside an element";
    final = now;
    ASSERT_EQ(std::memcmp(into.data(), expected.data(), final), 0)
        << what << ": bytes called final are wrong after byte " << at;
  }
  EXPECT_EQ(final, bytes) << what << ": the whole block is not final once it has arrived";
  EXPECT_EQ(std::memcmp(into.data(), expected.data(), bytes), 0) << what;
  if (minPart > bytes) return;
  // Whole aligned pieces through take() must not have been copied first.
  size_t aligned = 0;
  for (const Arrival& a : pieces) {
    if (!a.throughWaiting && a.misalign % es == 0 && a.bytes % es == 0) aligned += a.bytes;
  }
  if (std::all_of(pieces.begin(), pieces.end(),
                  [&](const Arrival& a) { return a.bytes % es == 0; })) {
    EXPECT_GE(reducedInPlace, aligned) << what << ": aligned whole elements were copied first";
  }
}

TEST(ArrivingReduction, WholeAlignedPiecesAreReducedWhereTheyLie) {
  for (size_t es : {1U, 2U, 4U, 8U}) {
    feed(es, {{es * 1000}, {es * 4096}, {es * 3}}, 32, "es " + std::to_string(es));
  }
}

TEST(ArrivingReduction, ElementsSplitBetweenPiecesComeOutRight) {
  for (size_t es : {2U, 4U, 8U}) {
    // 8-byte elements split 3 + 5, 7 + 1, ...; pieces of odd sizes at odd addresses.
    std::vector<Arrival> pieces;
    std::mt19937 random(static_cast<uint32_t>(es));
    size_t total = 0;
    for (int i = 0; i < 200; ++i) {
      Arrival a;
      a.bytes = 1 + random() % (i % 10 == 0 ? 5000 : 37);
      a.misalign = random() % 8;
      pieces.push_back(a);
      total += a.bytes;
    }
    if (total % es != 0) pieces.push_back({es - total % es});
    for (size_t minPart : {size_t{1}, size_t{64}, size_t{1} << 20}) {
      feed(es, pieces, minPart,
           "es " + std::to_string(es) + ", parts of " + std::to_string(minPart) + " bytes");
    }
  }
}

TEST(ArrivingReduction, PiecesReadIntoTheWaitingMemoryMixWithPiecesTakenInPlace) {
  for (size_t es : {1U, 4U, 8U}) {
    std::vector<Arrival> pieces;
    for (int i = 0; i < 60; ++i) {
      Arrival a;
      a.bytes = (i % 3 == 0) ? es * 100 + 3 : es * 50 + (i % 7);
      a.throughWaiting = i % 4 == 1;
      a.misalign = (i % 5 == 0) ? 1 : 0;
      pieces.push_back(a);
    }
    size_t total = 0;
    for (const Arrival& a : pieces) total += a.bytes;
    if (total % es != 0) pieces.push_back({es - total % es});
    for (size_t minPart : {size_t{1}, size_t{256}, size_t{1} << 20}) {
      feed(es, pieces, minPart,
           "es " + std::to_string(es) + ", parts of " + std::to_string(minPart) + " bytes");
    }
  }
}

}  // namespace
}  // namespace loom
