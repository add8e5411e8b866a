"""What a copy kernel moves between two GPUs, without loom: the ceiling loom's CUDA
kernels work under when each rank has its own GPU. A grid-stride kernel of 16-byte loads
and stores (as loom_copy; `unroll` loads in flight per thread before their stores) copies
256 MiB GPU 0 to GPU 0, GPU 1 to GPU 0 (reading a peer), GPU 0 to GPU 1 (writing a peer),
and both GPUs reading each other at once (what every all_gather and all_reduce step does),
at several grid sizes; beside them torch's peer copy (the copy engines). Needs CuPy and two
GPUs with peer access (NVLink).

    python3 tests/cuda/nvlink_probe.py
"""

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


def main():
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
