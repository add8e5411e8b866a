"""Starting the ranks of the GPU-host benchmarks and probes in tests/cuda: spawned processes
that meet on a fresh local TCP port, rank 0 reporting back."""

from __future__ import annotations

import socket

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
