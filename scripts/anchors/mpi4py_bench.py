"""Open MPI through mpi4py: the CPU collectives anchor of the CPU-speed issue, measured the way
../shared/anchors' oneCCL and DeepSpeed benchmarks measure theirs, so their lines sit side by
side (scripts/anchors/table.py).

    mpirun --allow-run-as-root -np 4 python3 scripts/anchors/mpi4py_bench.py [MAX_BYTES] [OPS]

float32; sizes 8 B, 64 B, 1 KiB, 16 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB, 16 MiB, 64 MiB up to
MAX_BYTES (default 64 MiB); OPS a comma list of allreduce, allgather, reduce_scatter, broadcast,
alltoall (default all). Per (op, size): 5 warm-up calls, then 50 timed calls below 1 MiB and 10
from 1 MiB, each after an MPI barrier; rank 0 times the call; the median is reported. Bytes
count as nccl-tests does (allgather: the whole output; reduce_scatter: the whole input;
alltoall: one rank's buffer), busbw with its factors. After timing, one more call's result is
checked exactly on every rank; the wrong elements of all ranks are counted.

Output, one line per point: openmpi cpu P=<P> <op> bytes=<B> t_us=<median> busbw=<GB/s>
then "# RESULT: all results verified correct" or "# RESULT: <n> WRONG elements"; exit 1 if any.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

SIZES = [8, 64, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
OPS = ["allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall"]


def case(op: str, nbytes: int, comm):
    """(call, check, busbw factor): `call()` runs the op once; `check()` counts wrong elements."""
    P, r = comm.Get_size(), comm.Get_rank()
    whole = max(1, nbytes // 4)
    block = max(1, whole // P)
    if op == "allreduce":
        send, recv = np.full(whole, r + 1, np.float32), np.empty(whole, np.float32)
        return (lambda: comm.Allreduce(send, recv, MPI.SUM),
                lambda: int(np.count_nonzero(recv != P * (P + 1) // 2)), 2 * (P - 1) / P)
    if op == "allgather":
        send, recv = np.full(block, r + 1, np.float32), np.empty(block * P, np.float32)
        want = np.repeat(np.arange(1, P + 1, dtype=np.float32), block)
        return lambda: comm.Allgather(send, recv), lambda: int(np.count_nonzero(recv != want)), (P - 1) / P
    if op == "reduce_scatter":
        send, recv = np.full(block * P, r + 1, np.float32), np.empty(block, np.float32)
        return (lambda: comm.Reduce_scatter_block(send, recv, MPI.SUM),
                lambda: int(np.count_nonzero(recv != P * (P + 1) // 2)), (P - 1) / P)
    if op == "broadcast":
        buf = np.full(whole, 1.0 if r == 0 else 0.0, np.float32)
        return lambda: comm.Bcast(buf, root=0), lambda: int(np.count_nonzero(buf != 1.0)), 1.0
    if op == "alltoall":
        send = np.repeat(np.arange(r * P, r * P + P, dtype=np.float32), block)
        recv = np.empty(block * P, np.float32)
        want = np.repeat(np.arange(P, dtype=np.float32) * P + r, block)
        return lambda: comm.Alltoall(send, recv), lambda: int(np.count_nonzero(recv != want)), (P - 1) / P
    raise ValueError(f"unknown op {op}; use {', '.join(OPS)}")


def main() -> int:
    comm = MPI.COMM_WORLD
    P, r = comm.Get_size(), comm.Get_rank()
    max_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
    ops = sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] != "all" else OPS
    if r == 0:
        print(f"# {MPI.Get_library_version().splitlines()[0].strip()}; mpi4py; P={P} max_bytes={max_bytes}", flush=True)
    wrong_total = 0
    for op in ops:
        for nbytes in (s for s in SIZES if s <= max_bytes):
            call, check, factor = case(op, nbytes, comm)
            for _ in range(5):
                call()
            samples = []
            for _ in range(50 if nbytes < (1 << 20) else 10):
                comm.Barrier()
                t0 = time.perf_counter()
                call()
                samples.append(time.perf_counter() - t0)
            call()
            wrong = comm.allreduce(check(), MPI.SUM)
            wrong_total += wrong
            if r == 0:
                t = statistics.median(samples)
                print(f"openmpi cpu P={P} {op} bytes={nbytes} t_us={t * 1e6:.2f} busbw={nbytes / t * factor / 1e9:.3f}"
                      + (f" WRONG={wrong}" if wrong else ""), flush=True)
    if r == 0:
        print("# RESULT: all results verified correct" if wrong_total == 0 else f"# RESULT: {wrong_total} WRONG elements",
              flush=True)
    return 1 if wrong_total else 0


if __name__ == "__main__":
    sys.exit(main())
