#pragma once

// Little-endian serialisation for the few binary messages loom sends (store protocol,
// bootstrap roster). Reader never reads past its span: every getter reports failure instead.

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace loom {

/// Appends little-endian values to a byte vector.
class ByteWriter {
 public:
  template <class T>
  void integer(T v) {
    for (size_t i = 0; i < sizeof(T); ++i) {
      bytes_.push_back(static_cast<uint8_t>(static_cast<uint64_t>(v) >> (8 * i)));
    }
  }
  void raw(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    bytes_.insert(bytes_.end(), p, p + n);
  }
  /// A u32 length, then the bytes.
  void string(const std::string& s) {
    integer<uint32_t>(static_cast<uint32_t>(s.size()));
    raw(s.data(), s.size());
  }
  std::vector<uint8_t>& bytes() { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

/// Reads little-endian values from a span; every call returns false once input runs out.
class ByteReader {
 public:
  explicit ByteReader(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  template <class T>
  bool integer(T* v) {
    if (remaining() < sizeof(T)) return false;
    uint64_t u = 0;
    for (size_t i = 0; i < sizeof(T); ++i) u |= uint64_t{bytes_[pos_ + i]} << (8 * i);
    *v = static_cast<T>(u);
    pos_ += sizeof(T);
    return true;
  }
  bool raw(void* out, size_t n) {
    if (remaining() < n) return false;
    std::memcpy(out, bytes_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  /// A u32 length (at most `maxLength`), then the bytes.
  bool string(std::string* s, size_t maxLength) {
    uint32_t n = 0;
    if (!integer(&n) || n > maxLength || remaining() < n) return false;
    s->assign(reinterpret_cast<const char*>(bytes_.data() + pos_), n);
    pos_ += n;
    return true;
  }
  /// A view of the next n bytes.
  bool view(size_t n, std::span<const uint8_t>* out) {
    if (remaining() < n) return false;
    *out = bytes_.subspan(pos_, n);
    pos_ += n;
    return true;
  }
  size_t remaining() const { return bytes_.size() - pos_; }
  bool atEnd() const { return pos_ == bytes_.size(); }

 private:
  std::span<const uint8_t> bytes_;
  size_t pos_ = 0;
};

}  // namespace loom
