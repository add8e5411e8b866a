#!/usr/bin/env python3
"""Why a c10d call can take longer than the same call through torch.ops.loom: times an
all_reduce through each path after each kind of barrier (c10d's, the op's one-element
all_reduce, none), in interleaved rounds, and reports per combination the median of rank 0's
call time (what `python -m loom.bench` reports), of the slowest rank's, and how far apart
the ranks left the barrier and the call (CLOCK_MONOTONIC is one clock for every process of
a host), and how long after rank 0 the last rank began its call (what rank 0's call must
wait for at least, whatever the backend: torch's no-op backend, which waits for no one,
never pays it).

    python3 scripts/c10d_probe.py --ranks 4 --bytes 512K 1M --rounds 3 --calls 30
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom.bench import parse_size

CALLS = ("c10d", "direct")
BARRIERS = ("c10d", "direct", "none")


def rank_main(rank: int, args, init: str) -> None:
    import loom  # noqa: F401  (registers the backend and torch.ops.loom)

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))
    dist.init_process_group("loom", init_method=init, rank=rank, world_size=args.ranks)
    name = dist.group.WORLD.group_name
    one = torch.zeros(1)
    barriers = {"c10d": dist.barrier, "direct": lambda: torch.ops.loom.all_reduce_(one, "sum", name),
                "none": lambda: None}
    for nbytes in args.bytes:
        t = torch.ones(nbytes // 4)
        calls = {"c10d": lambda: dist.all_reduce(t),
                 "direct": lambda: torch.ops.loom.all_reduce_(t, "sum", name)}
        rows = {}
        for _ in range(args.rounds):
            for call in CALLS:
                for barrier in BARRIERS:
                    for _ in range(3):  # warm-up
                        barriers[barrier]()
                        calls[call]()
                    # Per call: when it started (right after the barrier) and ended, µs on
                    # the host's monotonic clock.
                    stamps = torch.zeros(args.calls, 2, dtype=torch.float64)
                    for i in range(args.calls):
                        barriers[barrier]()
                        start = time.monotonic_ns()
                        calls[call]()
                        stamps[i, 0], stamps[i, 1] = start / 1e3, time.monotonic_ns() / 1e3
                    everyone = [torch.zeros_like(stamps) for _ in range(args.ranks)]
                    dist.all_gather(everyone, stamps)
                    s = torch.stack(everyone)  # rank, call, (start, end)
                    took = s[:, :, 1] - s[:, :, 0]
                    spread = s.max(0).values - s.min(0).values  # call, (start, end)
                    lag = s[:, :, 0].max(0).values - s[0, :, 0]  # the last start after rank 0's
                    row = rows.setdefault((call, barrier), {"rank0": [], "slowest": [], "enter": [],
                                                            "leave": [], "lag": []})
                    row["rank0"] += took[0].tolist()
                    row["slowest"] += took.max(0).values.tolist()
                    row["enter"] += spread[:, 0].tolist()
                    row["leave"] += spread[:, 1].tolist()
                    row["lag"] += lag.tolist()
        if rank == 0:
            print(f"\n## all_reduce of {nbytes} B, P = {args.ranks}, {args.rounds} rounds x {args.calls} calls "
                  "(medians, µs)")
            print(f"{'call':>7} {'after barrier':>14} {'rank 0':>9} {'slowest':>9} {'start skew':>11} "
                  f"{'end skew':>9} {'last start after rank 0':>24}")
            for (call, barrier), row in rows.items():
                med = {k: statistics.median(v) for k, v in row.items()}
                print(f"{call:>7} {barrier:>14} {med['rank0']:9.1f} {med['slowest']:9.1f} "
                      f"{med['enter']:11.1f} {med['leave']:9.1f} {med['lag']:24.1f}")
            sys.stdout.flush()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--bytes", type=parse_size, nargs="+", default=[512 << 10])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(args, f"file://{d}/rendezvous"), nprocs=args.ranks)


if __name__ == "__main__":
    main()
