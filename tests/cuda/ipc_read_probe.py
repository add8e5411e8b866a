"""How fast a process reads GPU memory another process on the same GPU shares with it,
without loom: one process makes a 64 MiB tensor and hands it over through
torch.multiprocessing (CUDA IPC: cudaIpcGetMemHandle for memory of the default caching
allocator, a file descriptor of a cuMem allocation under expandable segments); the other
times a device-to-device copy out of the shared tensor beside the same copy out of a tensor
of its own. Says whether reading a peer's buffer in place can beat staging it through loom's
workspace (cuMem memory it exports itself) on a GPU that ranks share (docs/PERFORMANCE.md,
"Reading peers' buffers in place, tried").

    python3 tests/cuda/ipc_read_probe.py            # default allocator
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 tests/cuda/ipc_read_probe.py
"""

import os
import statistics

import torch
import torch.multiprocessing as mp

BYTES = 64 << 20
REPEATS = 20


def owner(q, done):
    torch.cuda.set_device(0)
    src = torch.arange(BYTES // 4, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    q.put(src)
    done.wait()


def timed(dst, src):
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), sorted(times)[int(0.9 * (len(times) - 1))]


def main():
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=owner, args=(q, done))
    p.start()
    torch.cuda.set_device(0)
    shared = q.get()
    local = shared.clone()
    dst = torch.empty_like(local)
    for _ in range(3):  # warm up both paths
        dst.copy_(shared)
        dst.copy_(local)
    torch.cuda.synchronize()
    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")
    print(f"allocator: {alloc}; {BYTES >> 20} MiB device-to-device copy, ms (GB/s), median (p90) of {REPEATS}")
    for name, src in (("own tensor", local), ("peer's tensor via CUDA IPC", shared)):
        med, p90 = timed(dst, src)
        print(f"  from {name:<28} {med:8.3f} ({BYTES / med / 1e6:7.1f})  p90 {p90:8.3f}")
    assert torch.equal(dst, local), "the shared tensor's contents differ"
    del shared  # released before the owner exits
    torch.cuda.synchronize()
    done.set()
    p.join()


if __name__ == "__main__":
    main()
