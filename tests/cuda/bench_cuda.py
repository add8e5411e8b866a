"""loom against Gloo on CUDA tensors, several ranks sharing one GPU: time per call of each
collective and of a send/recv exchange between rank pairs (a barrier, the call repeated, a
stream synchronize, as seen from Python on rank 0), median and p90 of several repeats, for
sizes from 8 B up, with the bus bandwidth (nccl-tests' factors) beside the bandwidth of a
device-to-device copy of the same bytes by one rank, timed the same way in the same run.
Gloo takes CUDA tensors by staging them through the host and TCP (not for send/recv, which
it refuses on CUDA tensors). Results are checked once per size. With --floor, the same calls
on torch's no-op `fake` group too (the same CUDA tensors, nothing sent or launched): what a
call through torch.distributed costs before any backend does anything, the floor under
loom's and Gloo's times.

    python tests/cuda/bench_cuda.py --ranks 2 4 --max-bytes 64M --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch
import torch.distributed as dist

import loom  # noqa: F401
from loom._stats import p90 as nearest_rank_p90
from spawned import report, run_spawned

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv"]


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def call(op: str, x: torch.Tensor, out: torch.Tensor, group, world: int):
    if op == "all_reduce":
        dist.all_reduce(x, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, x, group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(x, out, group=group)
    elif op == "broadcast":
        dist.broadcast(x, src=0, group=group)
    elif op == "send_recv":
        exchange(x, out[: x.numel()], group, world)
    else:
        dist.all_to_all_single(out[: x.numel()], x, group=group)


def exchange(x: torch.Tensor, into: torch.Tensor, group, world: int) -> None:
    """Rank r sends x to rank r ^ 1 and receives its x into `into` (an odd last rank idles)."""
    peer = dist.get_rank() ^ 1
    if peer >= world:
        return
    ops = [dist.P2POp(dist.isend, x, peer, group), dist.P2POp(dist.irecv, into, peer, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()


def bus_bytes(op: str, size: int, world: int) -> float:
    """The bytes nccl-tests' bus bandwidth counts for one call: the larger buffer's bytes
    times its factor (`size` is the bytes each rank contributes)."""
    whole = size * world if op in ("all_gather", "reduce_scatter") else size
    factor = {"all_reduce": 2 * (world - 1) / world, "broadcast": 1.0,
              "send_recv": 1.0}.get(op, (world - 1) / world)
    return whole * factor


def time_copy(nbytes: int, dev, repeats: int, iters: int) -> list[float]:
    """Rank 0 alone copies `nbytes` device to device, timed as the collectives are."""
    src = torch.ones(max(1, nbytes // 4), device=dev)
    dst = torch.empty_like(src)
    samples = []
    for _ in range(repeats):
        dist.barrier(group=cpu_group)
        if dist.get_rank() == 0:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                dst.copy_(src)
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) / iters * 1e6)
    return samples


def expected(op: str, world: int, n: int) -> float | None:
    # Inputs are all ones: what every output element must be.
    return {"all_reduce": world, "reduce_scatter": world}.get(op, 1.0)


def time_op(op, n, group, world, dev, repeats, budget_s):
    if op == "all_to_all":
        n = max(world, n // world * world)  # equal blocks
    x = torch.ones(n, device=dev)
    out = torch.ones(n * world, device=dev)
    if op == "reduce_scatter":
        out, x = torch.ones(n * world, device=dev), torch.empty(n, device=dev)
    # Check once.
    check_in = torch.ones(n, device=dev)
    if op == "reduce_scatter":
        dist.reduce_scatter_tensor(x, out, group=group)
        result = x
    elif op == "all_reduce":
        result = check_in.clone()
        dist.all_reduce(result, group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, check_in, group=group)
        result = out
    elif op == "broadcast":
        result = check_in.clone()
        dist.broadcast(result, src=0, group=group)
    elif op == "send_recv":
        result = torch.ones(n, device=dev)
        if dist.get_rank() ^ 1 < world:
            result.zero_()
            exchange(check_in, result, group, world)
    else:
        result = torch.empty(n, device=dev)
        dist.all_to_all_single(result, check_in, group=group)
    torch.cuda.synchronize()
    wrong = int((result != expected(op, world, n)).sum().item())
    # Calibrate iterations to about budget_s per repeat; rank 0 decides for everyone, so
    # every rank issues the same collectives.
    iters = 1
    while True:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            call(op, x, out, group, world)
        torch.cuda.synchronize()
        more = torch.tensor([int(time.perf_counter() - t0 < budget_s / 4 and iters < 1000)])
        dist.broadcast(more, src=0, group=cpu_group)
        if not more.item():
            break
        iters *= 4
    samples = []
    for _ in range(repeats):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            call(op, x, out, group, world)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return samples, wrong


cpu_group = None


def worker(rank, world, port, args, queue):
    global cpu_group
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("loom", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    cpu_group = dist.new_group(backend="gloo")
    groups = {"loom": dist.group.WORLD, "gloo": cpu_group}
    if args.floor:
        # registers "fake"; a plain `import torch.testing...` here would make `torch` a local
        # name of this whole function
        from torch.testing._internal.distributed import fake_pg  # noqa: F401
        groups["fake"] = dist.new_group(backend="fake")
    size = 8
    rows = []
    copied = set()
    while size <= args.max_bytes:
        n = max(1, size // 4)
        for nbytes in sorted({size, size * world}):  # what one call's bus bytes are counted on
            copy = sorted(time_copy(nbytes, dev, args.repeats, 20))
            if rank == 0 and ("copy", nbytes) not in copied:
                copied.add(("copy", nbytes))
                rows.append(("copy", nbytes, "loom", statistics.median(copy), nearest_rank_p90(copy), 0))
        for op in args.ops:
            for name in ("loom", "gloo", "fake"):
                if name != "loom" and (size > args.gloo_max_bytes or op == "send_recv"):
                    continue
                if name not in groups:
                    continue
                samples, wrong = time_op(op, n, groups[name], world, dev, args.repeats, args.budget)
                wrong = 0 if name == "fake" else wrong  # the no-op group leaves the inputs
                if rank == 0:
                    s = sorted(samples)
                    rows.append((op, size, name, statistics.median(s), nearest_rank_p90(s), wrong))
                    print(f"P={world} {op:<15} {size:>10} B {name:<5} median {rows[-1][3]:10.1f} us  p90 {rows[-1][4]:10.1f} us  #wrong {wrong}", flush=True)
        size *= 4
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("64M"))
    parser.add_argument("--gloo-max-bytes", type=parse_bytes, default=parse_bytes("16M"))
    parser.add_argument("--ops", nargs="+", default=OPS)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.05, help="seconds per repeat")
    parser.add_argument("--out", default=None)
    parser.add_argument("--floor", action="store_true",
                        help="also time the calls on torch's no-op fake group (up to --gloo-max-bytes)")
    args = parser.parse_args()
    lines = []
    for world in args.ranks:
        rows = run_spawned(worker, world, args, timeout=3000)
        by = {(op, size, name): (med, p90, wrong) for op, size, name, med, p90, wrong in rows}
        lines.append(f"# P={world} ranks on one GPU ({torch.cuda.get_device_name(0)}); time per call in us")
        lines.append("# busbw: nccl-tests' bus bandwidth of loom's median, GB/s; copy: a device-to-device "
                     "copy of the same bytes by one rank in the same run, GB/s (bytes copied / time)")
        lines.append("# floor: the same call's median on torch's no-op fake group (--floor), us")
        lines.append(f"{'op':<15} {'bytes':>10} {'loom med':>10} {'loom p90':>10} {'gloo med':>10} {'gloo p90':>10} {'gloo/loom':>9} {'busbw':>7} {'copy':>7} {'wrong':>5} {'floor':>7}")
        for (op, size, name), (med, p90, wrong) in by.items():
            if name != "loom" or op == "copy":
                continue
            g = by.get((op, size, "gloo"))
            ratio = f"{g[0] / med:9.1f}" if g else f"{'':>9}"
            gm = f"{g[0]:10.1f} {g[1]:10.1f}" if g else f"{'-':>10} {'-':>10}"
            busbw = bus_bytes(op, size, world) / med / 1e3
            whole = size * world if op in ("all_gather", "reduce_scatter") else size
            copy = by.get(("copy", whole, "loom"))
            copy_bw = f"{whole / copy[0] / 1e3:7.1f}" if copy else f"{'-':>7}"
            f = by.get((op, size, "fake"))
            floor = f"{f[0]:7.1f}" if f else f"{'-':>7}"
            lines.append(f"{op:<15} {size:>10} {med:10.1f} {p90:10.1f} {gm} {ratio} {busbw:7.1f} {copy_bw} {wrong + (g[2] if g else 0):5d} {floor}")
    report(lines, args.out, "cuda_bench.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
