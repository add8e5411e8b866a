"""What sharing one GPU between processes costs, without loom: each process runs a tiny
kernel and waits for it, in a loop, alone and beside 1 and 3 others doing the same. The GPU
time-slices between processes, so each turn costs a switch; this is the floor under any
collective whose ranks share a GPU (docs/PERFORMANCE.md, "CUDA tensors").

    python3 tests/cuda/timeslice_probe.py
"""

import time

import torch
import torch.multiprocessing as mp

def loop(rank, n, q, barrier):
    torch.cuda.set_device(0)
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
        torch.cuda.synchronize()
    q.put((rank, (time.perf_counter() - t0) / n * 1e6))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    for procs in (1, 2, 4):
        q = ctx.Queue(); b = ctx.Barrier(procs)
        ps = [ctx.Process(target=loop, args=(r, 3000, q, b)) for r in range(procs)]
        [p.start() for p in ps]
        res = [q.get() for _ in ps]
        [p.join() for p in ps]
        print(f"{procs} processes: tiny kernel + synchronize: " + ", ".join(f"{us:.1f}" for _, us in sorted(res)) + " us per iteration", flush=True)
