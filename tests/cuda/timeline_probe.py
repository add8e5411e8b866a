"""Where a large loom collective's time goes on the GPU: torch's profiler (CUPTI) records
every kernel rank 0's GPU runs during a few calls of one op, and this prints, per call, the
span from the first kernel to the last, how much of it each kind of loom kernel was running,
and how much of it no kernel ran (waits on peers' flags, which the GPU's front end does
between kernels, and launch gaps). One GPU per rank where there are enough GPUs, else the
ranks share GPU 0.

    python3 tests/cuda/timeline_probe.py --ranks 2 --ops all_reduce all_to_all --bytes 512M
"""

import argparse
import collections
import datetime
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import loom  # noqa: F401  (registers the backend)

sys.path.insert(0, os.path.dirname(__file__))
from bench_nccl import Point, free_port, keep_nvls_off, parse_bytes  # noqa: E402

CALLS = 3


def worker(rank, world, port, args, out):
    gpus = torch.cuda.device_count()
    dev = torch.device("cuda", rank if gpus >= world else 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:loom", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    for op in args.ops:
        point = Point(op, args.bytes, world, dev)
        for _ in range(3):
            point.call(None)
        torch.cuda.synchronize()
        dist.barrier()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(CALLS):
                dist.barrier()
                point.call(None)
                torch.cuda.synchronize()
        if rank == 0:
            path = os.path.join(out, f"{op}.json")
            prof.export_chrome_trace(path)
            summarize(op, args.bytes, path)
        del point
        torch.cuda.empty_cache()
    dist.destroy_process_group()


def summarize(op, nbytes, path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and "loom_" in e.get("name", "")),
                     key=lambda e: e["ts"])
    # Calls are separated by the barrier's gap (the host's synchronize and barrier): split
    # where consecutive kernels are more than 200 us apart.
    calls, current = [], []
    for k in kernels:
        if current and k["ts"] - (current[-1]["ts"] + current[-1]["dur"]) > 200:
            calls.append(current)
            current = []
        current.append(k)
    if current:
        calls.append(current)
    print(f"{op} {nbytes} bytes: {len(kernels)} loom kernels in {len(calls)} calls", flush=True)
    for i, call in enumerate(calls):
        span = call[-1]["ts"] + call[-1]["dur"] - call[0]["ts"]
        busy = collections.Counter()
        count = collections.Counter()
        covered, end = 0.0, call[0]["ts"]
        for k in call:
            name = k["name"].split("loom_")[1].split("(")[0]
            name = "reduce" if name.startswith("reduce") else name
            busy[name] += k["dur"]
            count[name] += 1
            start, stop = max(k["ts"], end), k["ts"] + k["dur"]
            if stop > start:
                covered += stop - start
                end = stop
        parts = ", ".join(f"{n} {busy[n]:.0f} us in {count[n]}" for n in sorted(busy))
        print(f"  call {i}: span {span:.0f} us; kernels running {covered:.0f} us ({parts}); "
              f"no kernel {span - covered:.0f} us; {nbytes / span / 1e3:.1f} GB/s of the buffer",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--ops", nargs="+", default=["all_reduce"])
    parser.add_argument("--bytes", type=parse_bytes, default=parse_bytes("512M"))
    parser.add_argument("--out", default=None, help="where the Chrome traces go")
    args = parser.parse_args()
    keep_nvls_off()
    out = args.out or tempfile.mkdtemp(prefix="loom-timeline-")
    os.makedirs(out, exist_ok=True)
    port = free_port()
    mp.spawn(worker, args=(args.ranks, port, args, out), nprocs=args.ranks)


if __name__ == "__main__":
    main()
