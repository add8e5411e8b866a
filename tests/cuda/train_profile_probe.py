"""Where a DDP or FSDP2 training step's time goes with one GPU per rank, loom against NCCL:
bench_nccl.py's model and step (build_step) under torch's profiler, rank 0's CPU time per
operator (the collectives' host path, the waits) and the step times, for each backend in
the same processes.

    python3 tests/cuda/train_profile_probe.py [--ranks 2] [--kind fsdp2] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import loom  # noqa: F401  (registers the backend)
from bench_nccl import build_step
from spawned import loom_and_nccl, report, run_spawned


def worker(rank: int, world: int, port: int, args, queue) -> None:
    dev, groups = loom_and_nccl(rank, world, port)
    lines = []
    for name, group in groups.items():
        step = build_step(args.kind, group, dev, torch.cuda.synchronize)
        for _ in range(5):
            step()
        times = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                dist.barrier(group=group)
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
        if rank == 0:
            lines.append(f"# {name}: {args.kind} step median {statistics.median(times) * 1e3:.2f} ms "
                         f"over {args.steps} profiled steps (P={world}, "
                         f"{torch.cuda.get_device_name(dev)})")
            lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        del step
        torch.cuda.empty_cache()
    if rank == 0:
        queue.put(lines)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--kind", choices=["ddp", "fsdp2"], default="fsdp2")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    report(run_spawned(worker, args.ranks, args, timeout=300), None, "")


if __name__ == "__main__":
    main()
