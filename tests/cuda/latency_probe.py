"""Where a small collective's time goes with one GPU per rank, loom against NCCL: the parts
of bench_nccl.py's timing (a barrier, the call, a stream synchronize) taken apart, median
microseconds over many calls of an 8-byte all_reduce as rank 0 sees them.

    python3 tests/cuda/latency_probe.py [--ranks 2] [--calls 2000]

Rows: the barrier alone; the call's return to Python (host enqueue, no synchronize); the
call and a synchronize (bench_nccl.py's number, less the barrier); a synchronize of an
idle stream; a trivial kernel and a synchronize (the launch and synchronize floor); and
back-to-back calls with one synchronize at the end (time per call once launches overlap).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import loom  # noqa: F401  (registers the backend)
from spawned import loom_and_nccl, report, run_spawned


def median_us(fn, calls: int, group) -> float:
    times = []
    for _ in range(calls):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[calls // 10:]) * 1e6


def worker(rank: int, world: int, port: int, args, queue) -> None:
    dev, groups = loom_and_nccl(rank, world, port)
    x = torch.zeros(2, device=dev)
    sync = torch.cuda.synchronize
    rows = []
    for name, group in groups.items():
        dist.all_reduce(x, group=group)  # set up
        sync()

        def call_sync():
            dist.all_reduce(x, group=group)
            sync()

        def burst():
            for _ in range(20):
                dist.all_reduce(x, group=group)
            sync()

        parts = {
            "barrier": lambda: dist.barrier(group=group),
            "call returns": lambda: dist.all_reduce(x, group=group),
            "call + synchronize": call_sync,
            "synchronize, idle": sync,
            "x.add_(0) + synchronize": lambda: (x.add_(0), sync()),
        }
        for part, fn in parts.items():
            sync()
            rows.append((name, part, median_us(fn, args.calls, group)))
        sync()
        rows.append((name, "per call, 20 back to back", median_us(burst, args.calls // 20, group) / 20))
    if rank == 0:
        lines = [f"# P={world}, one GPU per rank ({torch.cuda.get_device_name(dev)}), 8-byte "
                 f"all_reduce, median us over {args.calls} calls after a barrier each",
                 f"{'part':<28}{'loom':>10}{'nccl':>10}"]
        for part in dict.fromkeys(p for _, p, _ in rows):
            got = {n: v for n, p, v in rows if p == part}
            lines.append(f"{part:<28}{got['loom']:>10.1f}{got['nccl']:>10.1f}")
        queue.put(lines)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    report(run_spawned(worker, args.ranks, args, timeout=300), None, "")


if __name__ == "__main__":
    main()
