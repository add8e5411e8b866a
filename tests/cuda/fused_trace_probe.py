"""Where a fused loom collective's steps spend their time, per role of the kernel's blocks:
waiting for which peer flag, or moving bytes. Runs one op at one size a few times with
LOOM_CUDA_FUSED_TRACE set (thread 0 of every block records the GPU's global time at each
phase of each step; core/cuda_fused_trace.h), then reads every rank's record of the last call
and prints, per rank and role, the median step's waits and work and the share of the call
each took. One GPU per rank (the fused kernels run only there).

    python3 tests/cuda/fused_trace_probe.py --ranks 4 --ops broadcast all_reduce --bytes 1G

Times on one GPU compare with each other; clocks of different GPUs are not aligned, so
nothing here subtracts one GPU's time from another's.
"""

import argparse
import datetime
import glob
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import loom  # noqa: F401  (registers the backend)

sys.path.insert(0, os.path.dirname(__file__))
from bench_nccl import Point, free_port, keep_nvls_off, parse_bytes  # noqa: E402

CALLS = 5

# What each role's blocks do and wait for (fused_collective.cuh), by kernel kind.
ROLES = {
    "one-shot": [("push", "slot freed", None), ("receive", "arrivals", None)],
    "two-shot": [("scatter", "slot freed", None), ("own", "shares arrived", "gather freed"),
                 ("gather", "gathered", None)],
    "chain": [("link", "the step arrived", "next slot freed")],
    # A ring all_reduce's step is 2(P-1) hops: its points are the first hop's arrival, the end
    # of the passes that add (the share finished) and of the passes that copy.
    "ring": [("ring", "the first hop", None)],
}


def worker(rank, world, port, op, nbytes):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("cpu:gloo,cuda:loom", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    point = Point(op, nbytes, world, dev)
    for _ in range(CALLS):
        dist.barrier()
        point.call(None)
        torch.cuda.synchronize()
    dist.destroy_process_group()  # the communicator ends: each rank writes its record


def read(path):
    """The header's fields and the rows (role, block, sm, step, t0..t3) of one rank's record."""
    rows = []
    with open(path) as f:
        fields = f.readline().lstrip("# ").split()
        header = {fields[i]: int(fields[i + 1]) for i in range(0, len(fields), 2)}
        for line in f:
            if not line.startswith("#"):
                rows.append(tuple(int(x) for x in line.split()))
    return header, rows


def summarize(path, nbytes):
    h, rows = read(path)
    chained = "ring" if h["root"] < 0 else "chain"
    kind = chained if h.get("chain") else "two-shot" if h["two_shot"] else "one-shot"
    steps = min(h["steps"], 1024)
    # A row is this call's if its phases are in order and inside the call (rows of a role
    # a rank does not play keep older values).
    valid = [r for r in rows if 0 < r[4] <= r[5] <= r[6] <= r[7] and r[7] - r[4] < 10**9]
    if not valid:
        print(f"rank {h['rank']}: no steps recorded", flush=True)
        return
    start, end = min(r[4] for r in valid), max(r[7] for r in valid)
    span = (end - start) / 1e3
    role_of_root = " (root)" if kind in ("two-shot", "chain") and h["root"] == h["rank"] else ""
    print(f"rank {h['rank']}{role_of_root}: {h['blocks']} blocks per role, {h['steps']} steps of "
          f"{h['per_step'] * h['element_bytes'] / 2**20:.2f} MiB; the call's blocks ran "
          f"{span:.0f} us ({nbytes / span / 1e3:.0f} GB/s of the buffer)", flush=True)
    # Steady steps only: the first two have no slot to wait for, the last may be short.
    steady = [r for r in valid if 2 <= r[3] < steps - 1] or valid
    for role, (name, first, second) in enumerate(ROLES[kind]):
        mine = [r for r in steady if r[0] == role]
        if not mine:
            continue
        w1 = [(r[5] - r[4]) / 1e3 for r in mine]
        w2 = [(r[6] - r[5]) / 1e3 for r in mine]
        work = [(r[7] - r[6]) / 1e3 for r in mine]
        total = sum(w1) + sum(w2) + sum(work)
        waits = f"wait for {first} {statistics.median(w1):.1f} us ({100 * sum(w1) / total:.0f}%)"
        if kind == "ring":  # after the first hop each pass waits and works in turn
            waits += f", adding passes {statistics.median(w2):.1f} us ({100 * sum(w2) / total:.0f}%)"
        elif second:
            waits += f", for {second} {statistics.median(w2):.1f} us ({100 * sum(w2) / total:.0f}%)"
        worked = "copying passes" if kind == "ring" else "work"
        print(f"  {name:8s} median step: {waits}, {worked} {statistics.median(work):.1f} us "
              f"({100 * sum(work) / total:.0f}%); p90 work {sorted(work)[int(0.9 * len(work))]:.1f}"
              f" us; {len(mine)} block-steps", flush=True)
        # Every block moves as many bytes: how evenly did they? (Each block's work over the
        # whole call, and the SMs of the quickest and slowest.)
        per_block = {}
        for r in valid:
            if r[0] == role:
                work_us, sm = per_block.get(r[1], (0.0, r[2]))
                per_block[r[1]] = (work_us + (r[7] - r[6]) / 1e3, sm)
        ranked = sorted((w, b, sm) for b, (w, sm) in per_block.items())
        ends = lambda part: ", ".join(f"block {b} on SM {sm} {w:.0f}" for w, b, sm in part)
        print(f"           work per block over the call: {ranked[0][0]:.0f} to {ranked[-1][0]:.0f} us "
              f"(median {statistics.median(w for w, _, _ in ranked):.0f}); quickest {ends(ranked[:3])}; "
              f"slowest {ends(ranked[-3:])}", flush=True)
        if os.environ.get("FUSED_TRACE_BLOCKS"):
            print("           by SM: " + " ".join(f"{sm}:{w:.0f}" for w, _, sm in
                                               sorted(ranked, key=lambda x: x[2])), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--ops", nargs="+", default=["broadcast"])
    parser.add_argument("--bytes", type=parse_bytes, default=parse_bytes("1G"))
    parser.add_argument("--out", default=None, help="where the records go")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.ranks:
        sys.exit(f"fused_trace_probe: {args.ranks} ranks need a GPU each; this host has "
                 f"{torch.cuda.device_count()} (the fused kernels run only with a GPU per rank)")
    keep_nvls_off()
    out = args.out or tempfile.mkdtemp(prefix="loom-fused-trace-")
    os.makedirs(out, exist_ok=True)
    for op in args.ops:
        prefix = os.path.join(out, op)
        os.environ["LOOM_CUDA_FUSED_TRACE"] = prefix
        port = free_port()
        mp.spawn(worker, args=(args.ranks, port, op, args.bytes), nprocs=args.ranks)
        print(f"== {op}, {args.bytes} bytes, P = {args.ranks} (last of {CALLS} calls)", flush=True)
        paths = sorted(glob.glob(prefix + ".rank*.txt"))
        if not paths:
            sys.exit(f"fused_trace_probe: no record under {prefix}: did the call run fused?")
        for path in paths:
            summarize(path, args.bytes)


if __name__ == "__main__":
    main()
