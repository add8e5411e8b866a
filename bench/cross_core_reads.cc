// How fast a core reads lines that other cores have just written, the access pattern of a
// two-shot all_reduce on one host, and whether software prefetching changes it.
//
// T threads, one per CPU (0..T-1), stand for T ranks. Each round: every thread copies its
// private input (S bytes) into its shared slot; after a barrier, thread t reduces (float
// sum) slice t of every slot into slice t of its own slot; after another barrier, thread t
// copies slice q of slot q, for every q, into its private output (the gather). The reduce
// and gather phases read lines that other cores wrote moments before, as loom's do. Each
// phase is timed on every thread; a round's phase time is its slowest thread's.
//
//   cross-core-reads [-t T] [-s BYTES] [-r ROUNDS] [-d LINES]
//
// Prints, per variant, the median and p90 over rounds of each phase in µs: "plain" runs
// loops shaped like loom's (kernels/reduce_impl.h's 512-element blocks, source by source;
// memcpy for the gather), written here rather than called so that "prefetch D", the same
// loops with a prefetch D lines ahead in every source they read, differs by the prefetch.

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr size_t kLine = 64;
constexpr size_t kBlock = 512;  // floats per block, as in kernels/reduce_impl.h

struct Barrier {  // a spinning sense barrier for T threads
  std::atomic<int> arrived{0};
  std::atomic<int> generation{0};
  int count = 0;
  void wait() {
    const int gen = generation.load(std::memory_order_acquire);
    if (arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == count) {
      arrived.store(0, std::memory_order_relaxed);
      generation.store(gen + 1, std::memory_order_release);
      return;
    }
    while (generation.load(std::memory_order_acquire) == gen) _mm_pause();
  }
};

// dst[i] = sum over s of srcs[s][i], block by block, source by source (loom's loop shape),
// prefetching `ahead` lines beyond the part of each source being read (0: none).
void reduceSum(float* dst, const float* const* srcs, int nsrc, size_t count, size_t ahead) {
  alignas(64) float acc[kBlock];
  const size_t aheadFloats = ahead * kLine / sizeof(float);
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    for (int s = 0; s < nsrc; ++s) {
      const float* src = srcs[s] + base;
      if (ahead != 0) {
        for (size_t j = 0; j < n; j += kLine / sizeof(float)) {
          if (base + j + aheadFloats < count)
            _mm_prefetch(reinterpret_cast<const char*>(src + j + aheadFloats), _MM_HINT_T0);
        }
      }
      if (s == 0) {
        for (size_t j = 0; j < n; ++j) acc[j] = src[j];
      } else {
        for (size_t j = 0; j < n; ++j) acc[j] += src[j];
      }
    }
    std::memcpy(dst + base, acc, n * sizeof(float));
  }
}

// memcpy, or (ahead > 0) a vector copy prefetching `ahead` lines ahead of what it reads.
void copyAhead(void* dst, const void* src, size_t n, size_t ahead) {
  if (ahead == 0) {
    std::memcpy(dst, src, n);
    return;
  }
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  const size_t dist = ahead * kLine;
  size_t i = 0;
  for (; i + kLine <= n; i += kLine) {
    if (i + dist < n) _mm_prefetch(reinterpret_cast<const char*>(s + i + dist), _MM_HINT_T0);
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
  }
  std::memcpy(d + i, s + i, n - i);
}

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

struct Result {
  std::vector<double> copyIn, reduce, gather;  // µs per round, slowest thread
};

Result run(int threads, size_t bytes, int rounds, size_t ahead) {
  const size_t count = bytes / sizeof(float);
  const size_t slice = count / static_cast<size_t>(threads);
  std::vector<float*> slots(threads), inputs(threads), outputs(threads);
  for (int t = 0; t < threads; ++t) {
    slots[t] = static_cast<float*>(std::aligned_alloc(4096, bytes));
    inputs[t] = static_cast<float*>(std::aligned_alloc(4096, bytes));
    outputs[t] = static_cast<float*>(std::aligned_alloc(4096, bytes));
    for (size_t i = 0; i < count; ++i) inputs[t][i] = static_cast<float>((i + t) % 7);
    std::memset(slots[t], 0, bytes);
    std::memset(outputs[t], 0, bytes);
  }
  Barrier barrier;
  barrier.count = threads;
  // times[phase][round][thread]
  std::vector<std::vector<std::vector<double>>> times(
      3, std::vector<std::vector<double>>(rounds, std::vector<double>(threads)));
  auto body = [&](int t) {
    pin(t);
    using Clock = std::chrono::steady_clock;
    auto us = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double, std::micro>(b - a).count();
    };
    std::vector<const float*> srcs(threads);
    for (int r = -5; r < rounds; ++r) {  // five warm-up rounds
      barrier.wait();
      auto t0 = Clock::now();
      std::memcpy(slots[t], inputs[t], bytes);
      auto t1 = Clock::now();
      barrier.wait();
      auto t2 = Clock::now();
      for (int q = 0; q < threads; ++q) srcs[q] = slots[q] + slice * t;
      reduceSum(slots[t] + slice * t, srcs.data(), threads, slice, ahead);
      auto t3 = Clock::now();
      barrier.wait();
      auto t4 = Clock::now();
      for (int q = 0; q < threads; ++q) {
        copyAhead(outputs[t] + slice * q, slots[q] + slice * q, slice * sizeof(float), ahead);
      }
      auto t5 = Clock::now();
      if (r >= 0) {
        times[0][r][t] = us(t0, t1);
        times[1][r][t] = us(t2, t3);
        times[2][r][t] = us(t4, t5);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(body, t);
  for (auto& th : pool) th.join();
  // Check: every output element is the sum over ranks of (i + t) % 7.
  for (int t = 0; t < threads; ++t) {
    for (size_t i = 0; i < slice * threads; i += 97) {
      float want = 0;
      for (int q = 0; q < threads; ++q) want += static_cast<float>((i + q) % 7);
      if (outputs[t][i] != want) {
        std::fprintf(stderr, "wrong: thread %d element %zu: %g, want %g\n", t, i, outputs[t][i],
                     want);
        std::exit(1);
      }
    }
  }
  Result res;
  for (int r = 0; r < rounds; ++r) {
    res.copyIn.push_back(*std::max_element(times[0][r].begin(), times[0][r].end()));
    res.reduce.push_back(*std::max_element(times[1][r].begin(), times[1][r].end()));
    res.gather.push_back(*std::max_element(times[2][r].begin(), times[2][r].end()));
  }
  for (int t = 0; t < threads; ++t) {
    std::free(slots[t]);
    std::free(inputs[t]);
    std::free(outputs[t]);
  }
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 16;
  size_t bytes = size_t{1} << 20;
  int rounds = 200;
  std::vector<size_t> aheads = {0, 4, 8, 16, 32};
  const auto usage = [](const char* why) {
    std::fprintf(stderr,
                 "cross-core-reads: %s\nusage: cross-core-reads [-t THREADS (1 to the CPUs)] "
                 "[-s BYTES (at least 64 per thread)] [-r ROUNDS (1 or more)] [-d LINES]\n",
                 why);
    return 2;
  };
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return usage(("no value after " + flag).c_str());
    const char* value = argv[i + 1];
    if (flag == "-t") {
      threads = std::atoi(value);
    } else if (flag == "-s") {
      bytes = std::strtoull(value, nullptr, 10);
    } else if (flag == "-r") {
      rounds = std::atoi(value);
    } else if (flag == "-d") {
      aheads = {0, std::strtoull(value, nullptr, 10)};
    } else {
      return usage(("unknown option " + flag).c_str());
    }
  }
  const int cpus = static_cast<int>(std::thread::hardware_concurrency());
  if (threads < 1 || threads > cpus) return usage("-t: one thread per CPU, so 1 to the CPUs");
  if (rounds < 1) return usage("-r: at least one round");
  bytes = bytes / (kLine * threads) * (kLine * threads);
  if (bytes == 0) return usage("-s: at least one 64-byte line per thread");
  std::printf(
      "# %d threads, %zu bytes per slot, %d rounds; µs per phase, median / p90 of the slowest "
      "thread\n",
      threads, bytes, rounds);
  std::printf("%-12s %18s %18s %18s\n", "variant", "copy in", "reduce", "gather");
  // Interleave the variants twice so a drift of the machine shows as disagreement.
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t ahead : aheads) {
      const Result r = run(threads, bytes, rounds, ahead);
      const std::string name = ahead == 0 ? "plain" : "prefetch " + std::to_string(ahead);
      std::printf("%-12s %8.1f / %7.1f %8.1f / %7.1f %8.1f / %7.1f\n", name.c_str(),
                  percentile(r.copyIn, 0.5), percentile(r.copyIn, 0.9), percentile(r.reduce, 0.5),
                  percentile(r.reduce, 0.9), percentile(r.gather, 0.5), percentile(r.gather, 0.9));
    }
  }
  return 0;
}
