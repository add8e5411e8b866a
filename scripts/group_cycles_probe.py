#!/usr/bin/env python3
"""What a process keeps after making, using and destroying whole process groups again and
again: rank 0's resident memory (VmRSS), threads, memory mappings and open fds after cycles
1, 10, 50, ... of init_process_group, five 256 KiB all_reduces, a barrier and
destroy_process_group, for each backend named, one after the other (each its own ranks).

    OMP_WAIT_POLICY=PASSIVE python3 scripts/group_cycles_probe.py --ranks 2 --cycles 300 --backends loom gloo

tests/python/test_faults.py checks the threads, fds and mappings in CI; the memory is only
reported here, with what malloc's main arena holds in use and free, and VmRSS once more after
malloc_trim(0) at the end: memory that is free inside the arena but not handed back
(fragmentation) is no leak, memory in use that grows would be.
"""

import argparse
import ctypes
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import loom  # noqa: F401  (registers the backend)


class MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (malloc's main arena)."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2


def footprint() -> tuple[str, int, int, int]:
    """VmRSS and its parts in KiB (with what malloc's main arena holds, in use and free),
    threads, mappings and fds of this process."""
    kib = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")):
                kib[line.split(":")[0]] = int(line.split()[1])
    heap = LIBC.mallinfo2()
    rss = (f"{kib['VmRSS']} KiB (anonymous {kib['RssAnon']}, files {kib['RssFile']}, "
           f"shared {kib['RssShmem']}; malloc in use {(heap.uordblks + heap.hblkhd) >> 10}, "
           f"free {heap.fordblks >> 10})")
    with open("/proc/self/maps") as maps:
        mappings = sum(1 for _ in maps)
    return rss, len(os.listdir("/proc/self/task")), mappings, len(os.listdir("/proc/self/fd"))


def rank_main(rank: int, world: int, backend: str, cycles: int, store_dir: str) -> None:
    samples = []
    for i in range(cycles):
        store = dist.FileStore(os.path.join(store_dir, f"{backend}{i}"), world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        t = torch.ones(1 << 16)
        for _ in range(5):
            dist.all_reduce(t)
        dist.barrier()
        dist.destroy_process_group()
        del store
        gc.collect()
        samples.append(footprint())
    if rank == 0:
        for i in sorted({0, 9, 49, 99, 149, 199, 249, 299, cycles - 1}):
            if i < cycles:
                rss, threads, mappings, fds = samples[i]
                print(f"{backend:6s} after cycle {i + 1:4d}: VmRSS {rss}, threads {threads}, "
                      f"mappings {mappings}, fds {fds}", flush=True)
        LIBC.malloc_trim(0)  # hands malloc's free pages back: what is left is what is used
        print(f"{backend:6s} after malloc_trim(0): VmRSS {footprint()[0]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--backends", nargs="+", default=["loom", "gloo"])
    args = parser.parse_args()
    for backend in args.backends:
        with tempfile.TemporaryDirectory() as store_dir:
            mp.start_processes(rank_main, args=(args.ranks, backend, args.cycles, store_dir),
                               nprocs=args.ranks, start_method="spawn")


if __name__ == "__main__":
    main()
