// A block reduced piece by piece as it arrives.

#include "algorithms/arriving_reduction.h"

#include <algorithm>
#include <cstring>

#include "util/trace.h"

namespace loom {

void ArrivingReduction::reduceWaiting(size_t upto) {
  if (upto <= reduced_) return;
  reduce_(into_ + reduced_, waiting_ + reduced_, (upto - reduced_) / es_);
  reduced_ = upto;
}

void ArrivingReduction::take(size_t at, std::span<const uint8_t> view) {
  size_t took = 0;
  if (at > reduced_) {
    // Bytes wait before these (the start of an element the last piece split, or bytes that
    // came through `waiting`): complete their element, then reduce everything waiting.
    const size_t boundary = std::min(at + view.size(), (at + es_ - 1) / es_ * es_);
    took = boundary - at;
    if (took > 0) std::memcpy(waiting_ + at, view.data(), took);
    if (boundary % es_ == 0) reduceWaiting(boundary);
  }
  const uint8_t* rest = view.data() + took;
  if (at + took == reduced_ && reinterpret_cast<uintptr_t>(rest) % es_ == 0) {
    const size_t whole = (view.size() - took) / es_ * es_;
    if (whole > 0) {
      reduce_(into_ + reduced_, rest, whole / es_);
      reduced_ += whole;
      took += whole;
    }
  }
  if (took < view.size()) {
    const trace::Span span("copy out of a frame", view.size() - took);
    std::memcpy(waiting_ + at + took, view.data() + took, view.size() - took);
  }
}

size_t ArrivingReduction::landed(size_t arrived) {
  const size_t whole = arrived / es_ * es_;
  if (whole > reduced_ && (whole - reduced_ >= minPart_ || arrived == bytes_)) {
    reduceWaiting(whole);
  }
  return reduced_;
}

}  // namespace loom
