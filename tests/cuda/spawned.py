"""Starting the ranks of the GPU-host benchmarks and probes in tests/cuda (spawned processes
that meet on a fresh local TCP port, rank 0 reporting back), and printing and saving their
tables."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_spawned(worker, world: int, args, timeout: float):
    """Runs worker(rank, world, port, args, queue) in `world` spawned processes and returns
    what rank 0 put on the queue, once every process has ended."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=timeout)
    for p in procs:
        p.join()
    return result


def loom_and_nccl(rank: int, world: int, port: int):
    """In a spawned rank with a GPU of its own: joins the job on `port` and returns the GPU
    and a loom and an NCCL group over every rank, {"loom": ..., "nccl": ...}."""
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    return dev, {"loom": dist.new_group(backend="loom"), "nccl": dist.new_group(backend="nccl")}


def report(lines: list[str], out_dir: str | None, name: str) -> None:
    """Prints a benchmark's table and, with `out_dir`, writes it there as `name`."""
    text = "\n".join(lines)
    print(text)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text + "\n")
