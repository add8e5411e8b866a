"""Where the time goes when ranks that share one GPU put a kernel of their own between loom's
CUDA calls (a training loop's shape: compute, then a collective). Each variant runs the same
loop on every rank at once and reports rank 0's time per iteration (median of repeats):

    back_to_back       all_reduce, all_reduce, ...          (no kernel of the caller's)
    kernel_between     x.add_(0); all_reduce(x)            (on the default stream)
    kernel_side        the same on a side stream made current
    no_wait_back       all_reduce(async_op=True) without wait(); x.add_(0)
                       (the caller's stream never waits for the loom stream; wrong as a
                       program, but it separates the two directions of the dependency)
    kernel_alone       x.add_(0) only, no loom call (what the caller's kernel costs when
                       every rank runs it at once)
    kernel_sync        x.add_(0); all_reduce(x); torch.cuda.synchronize()

    python tests/cuda/interleave_probe.py --ranks 2
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch
import torch.distributed as dist

import loom  # noqa: F401
from spawned import run_spawned

VARIANTS = ["back_to_back", "kernel_between", "kernel_side", "no_wait_back", "kernel_alone",
            "kernel_sync"]


def iteration(variant: str, x: torch.Tensor) -> None:
    if variant == "back_to_back":
        dist.all_reduce(x)
    elif variant in ("kernel_between", "kernel_side"):
        x.add_(0)
        dist.all_reduce(x)
    elif variant == "no_wait_back":
        dist.all_reduce(x, async_op=True)
        x.add_(0)
    elif variant == "kernel_alone":
        x.add_(0)
    else:
        x.add_(0)
        dist.all_reduce(x)
        torch.cuda.synchronize()


def worker(rank: int, world: int, port: int, args, queue) -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("cpu:loom,cuda:loom", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120), device_id=dev)
    x = torch.zeros(256, device=dev)
    side = torch.cuda.Stream()
    results = {}
    for variant in VARIANTS:
        samples = []
        for _ in range(args.repeats):
            dist.barrier()
            torch.cuda.synchronize()
            stream = side if variant == "kernel_side" else torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    iteration(variant, x)
                torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) / args.iters * 1e6)
        results[variant] = sorted(samples)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    for world in args.ranks:
        results = run_spawned(worker, world, args, timeout=600)
        print(f"# P={world} ranks on one GPU ({torch.cuda.get_device_name(0)}); us per iteration, "
              f"{args.iters} iterations per run, {args.repeats} runs")
        for variant, s in results.items():
            print(f"{variant:<15} median {statistics.median(s):9.1f}  p90 {s[int(0.9 * (len(s) - 1))]:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
