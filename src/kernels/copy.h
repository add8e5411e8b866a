#pragma once

// Copies for large outputs. A plain store to memory that is not in cache first reads the
// line (read-for-ownership), so writing N bytes of output costs 2N bytes of memory traffic;
// non-temporal (streaming) stores write whole lines without reading them. Worth it only
// where the output is too large to stay in cache anyway: callers decide by size.

#include <cstddef>

namespace loom::kernels {

/// Copies n bytes with non-temporal stores where the CPU has them (AVX2 or AVX-512), else
/// memcpy. The stores are fenced before returning, so the data is visible to other threads
/// in the usual release/acquire way afterwards.
void copyStreaming(void* dst, const void* src, size_t n);

/// Bytes of last-level cache on this host (sysconf), or 32 MiB if unknown.
size_t lastLevelCacheBytes();

}  // namespace loom::kernels
