#pragma once

// A ring step's block reduced into its destination as its bytes arrive, in pieces of any
// size: whole elements straight out of the memory they landed in (a network link's frame),
// an element split between pieces through a waiting buffer. NetworkContext::ring runs one
// per step that reduces, on the thread that receives.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

namespace loom {

class ArrivingReduction {
 public:
  /// dst[i] = dst[i] (op) src[i] for `count` elements; src may be any element-aligned address.
  using Reduce = std::function<void(void* dst, const void* src, size_t count)>;

  /// `into` holds the block's own values and receives the result; `waiting` (`bytes` long)
  /// keeps arrived bytes not yet reduced. Bytes that waited are reduced in parts of at least
  /// `minPart` bytes (the last part whatever is left), so each kernel call is worth making.
  ArrivingReduction(void* into, void* waiting, size_t bytes, size_t elementBytes, size_t minPart,
                    Reduce reduce)
      : into_(static_cast<uint8_t*>(into)),
        waiting_(static_cast<uint8_t*>(waiting)),
        bytes_(bytes),
        es_(elementBytes),
        minPart_(minPart),
        reduce_(std::move(reduce)) {}

  /// Bytes [at, at + view.size()) of the block, where they lie: reduced from there where
  /// they make whole elements at an element-aligned address, else kept in `waiting`.
  /// Pieces come in order; bytes before `at` have come through take() or into `waiting`.
  void take(size_t at, std::span<const uint8_t> view);
  /// The block's first `arrived` bytes are here (through take(), or written into `waiting`
  /// by the caller): reduces what waits, once worth it. Returns how many of the block's
  /// bytes in `into` are final (whole elements, a prefix).
  size_t landed(size_t arrived);

 private:
  /// Reduces [reduced_, upto) out of `waiting`.
  void reduceWaiting(size_t upto);

  uint8_t* into_;
  uint8_t* waiting_;
  size_t bytes_;
  size_t es_;
  size_t minPart_;
  Reduce reduce_;
  size_t reduced_ = 0;
};

}  // namespace loom
