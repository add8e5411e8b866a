"""What a copy kernel moves between two GPUs, without loom: the ceiling loom's CUDA
kernels work under when each rank has its own GPU. A grid-stride kernel of 16-byte loads
and stores (as loom_copy; `unroll` loads in flight per thread before their stores) copies
256 MiB GPU 0 to GPU 0, GPU 1 to GPU 0 (reading a peer), GPU 0 to GPU 1 (writing a peer),
and both GPUs reading each other at once (what every all_gather and all_reduce step does),
at several grid sizes; beside them torch's peer copy (the copy engines). With more than two
GPUs (`--many`), what each GPU sends when several move at once, in the patterns collectives
use: one GPU to all its peers, every GPU to the next (a ring), every GPU to every peer with a
block per peer or with every block visiting every peer in turn (loom's fused kernels), and
the same reading instead of writing. Needs CuPy and GPUs with peer access (NVLink).

    python3 tests/cuda/nvlink_probe.py
    python3 tests/cuda/nvlink_probe.py --many
"""

import argparse
import statistics
import time

import cupy as cp
import torch

BYTES = 256 << 20
REPEATS = 10

SOURCE = r"""
extern "C" __global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                  unsigned long long n, int unroll) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  if (unroll == 4) {
    for (; i + 3 * stride < n; i += 4 * stride) {
      uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
      dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
    }
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

// n vectors from srcs[p] to dsts[p] for each of `parts` pairs. spread == 0: block b serves
// pair b % parts alone. spread == 1: the pairs are cut into slices of `slice` vectors, and a
// block copies its slice of every pair in turn, starting at a pair of its own.
extern "C" __global__ void pairs16(const unsigned long long* srcs, const unsigned long long* dsts,
                                   int parts, unsigned long long n, int spread,
                                   unsigned long long slice) {
  if (spread == 0) {
    const int part = blockIdx.x % parts;
    const uint4* src = (const uint4*)srcs[part];
    uint4* dst = (uint4*)dsts[part];
    const unsigned long long stride = (unsigned long long)(gridDim.x / parts) * blockDim.x;
    unsigned long long i = (blockIdx.x / parts) * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
      uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
      dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) dst[i] = src[i];
    return;
  }
  for (unsigned long long at = blockIdx.x * slice; at < n; at += gridDim.x * slice) {
    const unsigned long long end = at + slice < n ? at + slice : n;
    for (int k = 0; k < parts; ++k) {
      const int part = (blockIdx.x + k) % parts;
      const uint4* src = (const uint4*)srcs[part];
      uint4* dst = (uint4*)dsts[part];
      unsigned long long i = at + threadIdx.x;
      const unsigned step = blockDim.x;
      for (; i + 3 * step < end; i += 4 * step) {
        uint4 a = src[i], b = src[i + step], c = src[i + 2 * step], d = src[i + 3 * step];
        dst[i] = a; dst[i + step] = b; dst[i + 2 * step] = c; dst[i + 3 * step] = d;
      }
      for (; i < end; i += step) dst[i] = src[i];
    }
  }
}
"""


def kernel_on(dev: int):
    with cp.cuda.Device(dev):
        return cp.RawModule(code=SOURCE).get_function("copy16")


def timed(launches) -> tuple[float, float]:
    """GB/s (median, p90 of the slow side) of `launches` run together, each a (device,
    function) pair; the time is from the first launch to the last device done."""
    rates = []
    for i in range(REPEATS + 2):
        for dev, _ in launches:
            cp.cuda.Device(dev).synchronize()
        t0 = time.perf_counter()
        for dev, fn in launches:
            with cp.cuda.Device(dev):
                fn()
        for dev, _ in launches:
            cp.cuda.Device(dev).synchronize()
        if i >= 2:
            rates.append(BYTES / (time.perf_counter() - t0) / 1e9)
    rates.sort()
    return statistics.median(rates), rates[int(0.1 * (len(rates) - 1))]


def many() -> None:
    """Every GPU's egress (or ingress, reading) in GB/s when several GPUs move at once."""
    gpus = cp.cuda.runtime.getDeviceCount()
    assert gpus >= 3, "--many needs three GPUs or more"
    for a in range(gpus):
        with cp.cuda.Device(a):
            for b in range(gpus):
                if a != b and cp.cuda.runtime.deviceCanAccessPeer(a, b):
                    cp.cuda.runtime.deviceEnablePeerAccess(b)
    per = BYTES // (gpus - 1) // (64 << 10) * (64 << 10)  # bytes per peer
    n = per // 16
    src, dst, fns = {}, {}, {}
    for dev in range(gpus):
        with cp.cuda.Device(dev):
            # A source part and a landing part per peer.
            src[dev] = [cp.ones(per // 4, dtype=cp.float32) for _ in range(gpus)]
            dst[dev] = [cp.empty(per // 4, dtype=cp.float32) for _ in range(gpus)]
            fns[dev] = cp.RawModule(code=SOURCE).get_function("pairs16")
    sms = cp.cuda.Device(0).attributes["MultiProcessorCount"]

    def launch(runner, pairs, blocks, spread):
        with cp.cuda.Device(runner):
            srcs = cp.asarray([s.data.ptr for s, _ in pairs], dtype=cp.uint64)
            dsts = cp.asarray([d.data.ptr for _, d in pairs], dtype=cp.uint64)
        args = (srcs, dsts, cp.int32(len(pairs)), cp.uint64(n), cp.int32(spread),
                cp.uint64((64 << 10) // 16))
        return (runner, lambda: fns[runner]((blocks,), (512,), args)), len(pairs)

    def rate(launches, reps: int = 5) -> tuple[float, float]:
        """GB/s that the busiest GPU moves (median, p10), each GPU timed by its own events
        over `reps` launches back to back, so the launches' skew from Python hardly counts."""
        parts = max(k for _, k in launches)
        rates = []
        for i in range(REPEATS + 2):
            marks = []
            for (dev, fn), _ in launches:
                with cp.cuda.Device(dev):
                    start, end = cp.cuda.Event(), cp.cuda.Event()
                    start.record()
                    for _ in range(reps):
                        fn()
                    end.record()
                    marks.append((start, end))
            for (dev, _), _ in launches:
                cp.cuda.Device(dev).synchronize()
            slowest = max(cp.cuda.get_elapsed_time(a, b) for a, b in marks) * 1e-3
            if i >= 2:
                rates.append(reps * parts * per / slowest / 1e9)
        rates.sort()
        return statistics.median(rates), rates[int(0.1 * (len(rates) - 1))]

    peers = lambda g: [(g + d) % gpus for d in range(1, gpus)]  # noqa: E731
    nxt = lambda g: (g + 1) % gpus  # noqa: E731
    print(f"# {torch.cuda.get_device_name(0)} x{gpus}, {sms} SMs; {per >> 20} MiB per pair; "
          "GB/s that the busiest GPU sends (writes) or receives (reads), median (p10)")
    print(f"{'pattern':<52} {'blocks':>6} {'GB/s':>8} {'p10':>8}")
    for blocks in (42, 63, 126, 2 * sms):
        cases = {
            "write: GPU 0 to GPU 1": [launch(0, [(src[0][1], dst[1][0])], blocks, 0)],
            "write: GPU 0 to every peer, a block per peer": [
                launch(0, [(src[0][q], dst[q][0]) for q in peers(0)], blocks, 0)],
            "write: ring, every GPU to the next": [
                launch(g, [(src[g][nxt(g)], dst[nxt(g)][g])], blocks, 0) for g in range(gpus)],
            "write: every GPU to every peer, a block per peer": [
                launch(g, [(src[g][q], dst[q][g]) for q in peers(g)], blocks, 0)
                for g in range(gpus)],
            "write: every GPU to every peer, blocks in turn": [
                launch(g, [(src[g][q], dst[q][g]) for q in peers(g)], blocks, 1)
                for g in range(gpus)],
            "read: ring, every GPU from the previous": [
                launch(nxt(g), [(src[g][nxt(g)], dst[nxt(g)][g])], blocks, 0) for g in range(gpus)],
            "read: every GPU from every peer, a block per peer": [
                launch(g, [(src[q][g], dst[g][q]) for q in peers(g)], blocks, 0)
                for g in range(gpus)],
        }
        for name, launches in cases.items():
            med, p10 = rate(launches)
            print(f"{name:<52} {blocks:>6} {med:>8.1f} {p10:>8.1f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--many", action="store_true", help="the patterns of three GPUs or more")
    if parser.parse_args().many:
        return many()
    assert cp.cuda.runtime.getDeviceCount() >= 2, "needs two GPUs"
    for a, b in ((0, 1), (1, 0)):
        with cp.cuda.Device(a):
            if cp.cuda.runtime.deviceCanAccessPeer(a, b):
                cp.cuda.runtime.deviceEnablePeerAccess(b)
    n = BYTES // 16
    bufs = {}
    for dev in (0, 1):
        with cp.cuda.Device(dev):
            bufs[dev] = (cp.ones(BYTES // 4, dtype=cp.float32), cp.empty(BYTES // 4, dtype=cp.float32))
    fns = {dev: kernel_on(dev) for dev in (0, 1)}
    sms = cp.cuda.Device(0).attributes["MultiProcessorCount"]
    print(f"# {torch.cuda.get_device_name(0)} x2, {sms} SMs; 256 MiB per copy; GB/s median (p10)")
    print(f"{'copy':<34} {'blocks':>6} {'unroll':>6} {'GB/s':>8} {'p10':>8}")

    def launch(runner: int, src, dst, blocks: int, unroll: int):
        return (runner, lambda: fns[runner]((blocks,), (512,), (src, dst, cp.uint64(n), cp.int32(unroll))))

    for blocks in (sms, 2 * sms, 4 * sms, 8 * sms):
        for unroll in (1, 4):
            cases = {
                "local (GPU 0 -> GPU 0)": [launch(0, bufs[0][0], bufs[0][1], blocks, unroll)],
                "read peer (GPU 1 -> GPU 0)": [launch(0, bufs[1][0], bufs[0][1], blocks, unroll)],
                "write peer (GPU 0 -> GPU 1)": [launch(0, bufs[0][0], bufs[1][1], blocks, unroll)],
                "both read each other": [launch(0, bufs[1][0], bufs[0][1], blocks, unroll),
                                         launch(1, bufs[0][0], bufs[1][1], blocks, unroll)],
                "both write each other": [launch(0, bufs[0][0], bufs[1][1], blocks, unroll),
                                          launch(1, bufs[1][0], bufs[0][1], blocks, unroll)],
            }
            for name, launches in cases.items():
                med, p10 = timed(launches)
                print(f"{name:<34} {blocks:>6} {unroll:>6} {med:>8.1f} {p10:>8.1f}", flush=True)
    a = torch.ones(BYTES // 4, device="cuda:1")
    b = torch.empty(BYTES // 4, device="cuda:0")
    rates = []
    for i in range(REPEATS + 2):
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
        if i >= 2:
            rates.append(BYTES / (time.perf_counter() - t0) / 1e9)
    print(f"{'torch peer copy (copy engines)':<34} {'-':>6} {'-':>6} {statistics.median(rates):>8.1f} "
          f"{sorted(rates)[1]:>8.1f}")


if __name__ == "__main__":
    main()
