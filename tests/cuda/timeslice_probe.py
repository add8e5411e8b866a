"""What sharing one GPU between processes costs, without loom: each process runs a tiny
kernel and waits for it, in a loop, alone and beside 1 and 3 others doing the same. The GPU
time-slices between processes, so each turn costs a switch; this is the floor under any
collective whose ranks share a GPU (docs/PERFORMANCE.md, "CUDA tensors"). The same loop with
no kernel, only a small copy to pinned host memory and back (copy engines), says whether
staging a small message through the host escapes that floor.

    python3 tests/cuda/timeslice_probe.py
"""

import time

import torch
import torch.multiprocessing as mp

MODES = {
    "tiny kernel + synchronize": "kernel",
    "8 B copy to pinned host and back + synchronize": "copies",
}


def loop(rank, n, mode, q, barrier):
    torch.cuda.set_device(0)
    x = torch.zeros(2, device="cuda")
    host = torch.zeros(2, pin_memory=True)

    def once():
        if mode == "kernel":
            x.add_(1)
        else:
            host.copy_(x, non_blocking=True)
            x.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    for _ in range(100):
        once()
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        once()
    q.put((rank, (time.perf_counter() - t0) / n * 1e6))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    for name, mode in MODES.items():
        for procs in (1, 2, 4):
            q = ctx.Queue(); b = ctx.Barrier(procs)
            ps = [ctx.Process(target=loop, args=(r, 3000, mode, q, b)) for r in range(procs)]
            [p.start() for p in ps]
            res = [q.get() for _ in ps]
            [p.join() for p in ps]
            print(f"{procs} processes: {name}: " + ", ".join(f"{us:.1f}" for _, us in sorted(res)) + " us per iteration", flush=True)
