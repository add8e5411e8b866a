"""loom against NCCL through torch.distributed on CUDA tensors, one GPU per rank: all_reduce,
all_gather, reduce_scatter, broadcast and all_to_all from 8 B to 1 GiB (and, asked for with
`--ops send_recv`, nccl-tests' sendrecv: each rank sends to the next and receives from the one
before, in one `batch_isend_irecv`, as pipeline stages pass activations; with `--ops
all_to_allv`, all_to_all with its split sizes given, which takes the uneven form's path), timed the same way
for both (rank 0's view of a barrier, the call and a stream synchronize), median and p90 per
point, bus bandwidth with nccl-tests' factors, every point's result checked. Then DDP and
FSDP2 training steps with each backend, the two taking turns step by step. Both backends
run in the same processes, on the same tensors, one after the other at each point.

    python3 tests/cuda/bench_nccl.py --ranks 2 [--max-bytes 1G] [--out DIR]

`--device cpu` dry-runs the harness without a GPU (Gloo in NCCL's place).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import loom  # noqa: F401  (registers the backend)
from loom._stats import p90

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]
# nccl-tests' bus bandwidth factors (bytes counted: the larger buffer).
FACTOR = {"all_reduce": lambda p: 2 * (p - 1) / p, "all_gather": lambda p: (p - 1) / p,
          "reduce_scatter": lambda p: (p - 1) / p, "broadcast": lambda p: 1.0,
          "all_to_all": lambda p: (p - 1) / p, "all_to_allv": lambda p: (p - 1) / p,
          "send_recv": lambda p: 1.0}


def keep_nvls_off() -> None:
    """NVLink SHARP (multicast) off for NCCL, torch's symmetric memory and NVSHMEM, unless
    the caller set otherwise: the lent GPU hosts must not use it."""
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def sizes(lo: int, hi: int, factor: int = 4):
    """lo, factor x lo, factor^2 x lo, ... up to hi, and hi itself."""
    s = lo
    while s < hi:
        yield s
        s *= factor
    yield hi


class Point:
    """The buffers of one op at one size (float32; `count` elements in the larger buffer,
    a multiple of the world size)."""

    def __init__(self, op: str, nbytes: int, world: int, dev: torch.device):
        self.op = op
        self.count = max(nbytes // 4 // world, 1) * world
        n, part = self.count, self.count // world
        if op in ("all_reduce", "broadcast"):
            self.inp = torch.zeros(n, device=dev)
            self.out = self.inp
        elif op == "all_gather":
            self.inp, self.out = torch.zeros(part, device=dev), torch.zeros(n, device=dev)
        elif op == "reduce_scatter":
            self.inp, self.out = torch.zeros(n, device=dev), torch.zeros(part, device=dev)
        else:
            self.inp, self.out = torch.zeros(n, device=dev), torch.zeros(n, device=dev)

    def call(self, group) -> None:
        op = self.op
        if op == "send_recv":
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            peer = lambda r: dist.get_global_rank(group, r % world)  # noqa: E731
            ops = [dist.P2POp(dist.isend, self.inp, peer(rank + 1), group=group),
                   dist.P2POp(dist.irecv, self.out, peer(rank - 1), group=group)]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            return
        if op == "all_reduce":
            dist.all_reduce(self.inp, group=group)
        elif op == "all_gather":
            dist.all_gather_into_tensor(self.out, self.inp, group=group)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(self.out, self.inp, group=group)
        elif op == "broadcast":
            dist.broadcast(self.inp, src=0, group=group)
        elif op == "all_to_allv":
            # The same blocks, but with split sizes given: the uneven form's path (in loom,
            # where every rank has a GPU, the fused transfer; in NCCL, grouped sends and receives).
            splits = [self.count // dist.get_world_size(group)] * dist.get_world_size(group)
            dist.all_to_all_single(self.out, self.inp, splits, splits, group=group)
        else:
            dist.all_to_all_single(self.out, self.inp, group=group)

    def check(self, group, rank: int, world: int) -> bool:
        """One call on inputs that say who sent them and where each element sits (so a
        stale or misplaced slice shows, not only a missing one); True if every element is
        right. Values are whole numbers below 2^24, exact in float32."""
        op, n = self.op, self.count
        part = n // world
        dev = self.inp.device
        # Every element's place within its rank's part, 0..1020.
        where = (torch.arange(part, device=dev) % 1021).to(torch.float32)
        total = world * (world + 1) / 2
        if op == "send_recv":
            # rank r sends 1024 x place + r
            everywhere = (torch.arange(n, device=dev) % 1021).to(torch.float32) * 1024
            self.inp.copy_(everywhere + rank)
        elif op in ("all_to_all", "all_to_allv"):
            # block q of rank r holds 1024 x place + r x world + q
            sender = torch.arange(world, device=dev).repeat_interleave(part) + rank * world
            self.inp.copy_(where.repeat(world) * 1024 + sender)
        elif op == "all_gather":
            self.inp.copy_(where + rank + 1)
        else:
            self.inp.copy_(where.repeat(world) + rank + 1)
        self.call(group)
        if self.inp.is_cuda:
            torch.cuda.synchronize()
        if op == "send_recv":
            ok = bool(torch.all(self.out == everywhere + (rank - 1) % world))
        elif op == "all_reduce":
            ok = bool(torch.all(self.inp == where.repeat(world) * world + total))
        elif op == "broadcast":
            ok = bool(torch.all(self.inp == where.repeat(world) + 1))
        elif op == "all_gather":
            ranks = torch.arange(1, world + 1, device=dev, dtype=torch.float32)
            ok = bool(torch.all(self.out == where.repeat(world) + ranks.repeat_interleave(part)))
        elif op == "reduce_scatter":
            ok = bool(torch.all(self.out == where * world + total))
        else:
            sender = torch.arange(world, device=dev) * world + rank
            ok = bool(torch.all(self.out == where.repeat(world) * 1024 + sender.repeat_interleave(part)))
        self.inp.zero_()
        if self.out is not self.inp:
            self.out.zero_()
        return ok


def time_point(point: Point, group, budget: float, sync) -> list[float]:
    """Seconds per call as rank 0 sees it: a barrier, the call, a stream synchronize. The
    ranks agree on how many calls (the most any rank's first five say fit in `budget`)."""
    times = []
    for i in range(7):  # two warm-ups, then five timed
        dist.barrier(group=group)
        t0 = time.perf_counter()
        point.call(group)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    more = torch.tensor([min(int(budget / statistics.median(times)), 195)])
    dist.all_reduce(more, op=dist.ReduceOp.MAX)  # the default group's CPU backend
    for _ in range(int(more.item())):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        point.call(group)
        sync()
        times.append(time.perf_counter() - t0)
    return times


def build_step(kind: str, group, dev, sync):
    """One training step of a 4-layer MLP (about 100 MB of float32 gradients) under DDP or
    FSDP2 on `group`, as a function."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2560, 2560) for _ in range(4)]).to(dev)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, process_group=group,
                                        device_ids=[dev.index] if dev.type == "cuda" else None)
    else:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
        mesh = DeviceMesh.from_group(group, dev.type)
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 2560, device=dev)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        sync()

    return step


def train_steps(kind: str, groups: dict, dev, steps: int, sync) -> dict[str, list[float]]:
    """Seconds per training step with each backend. The backends take turns step by step
    (which goes first alternates), after three warm-up steps each, so that a drift of the
    machine (clocks, the allocator's growth, other load) falls on both alike."""
    runs = {name: build_step(kind, group, dev, sync) for name, group in groups.items()}
    times = {name: [] for name in runs}
    names = list(runs)
    for i in range(steps + 3):
        for name in (names if i % 2 == 0 else names[::-1]):
            dist.barrier(group=groups[name])
            t0 = time.perf_counter()
            runs[name]()
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    return times


def worker(rank: int, world: int, port: int, args, results) -> None:
    cuda = args.device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    groups = {"loom": dist.new_group(backend="loom"),
              "nccl" if cuda else "gloo": dist.new_group(backend="nccl" if cuda else "gloo")}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for op in args.ops:
        for nbytes in (s for s in sizes(8, args.max_bytes, args.factor) if s >= args.min_bytes):
            point = Point(op, nbytes, world, dev)
            for name, group in groups.items():
                times = time_point(point, group, args.budget, sync)
                ok = point.check(group, rank, world)
                rows.append({"op": op, "bytes": point.count * 4, "backend": name,
                             "median_us": statistics.median(times) * 1e6,
                             "p90_us": p90(sorted(times)) * 1e6,
                             "calls": len(times), "ok": ok})
            del point
            if cuda:
                torch.cuda.empty_cache()
            if rank == 0:
                print(f"  {op} {nbytes} done", file=sys.stderr, flush=True)
    steps = []
    for kind in args.train:
        try:
            for name, t in train_steps(kind, groups, dev, args.steps, sync).items():
                steps.append({"kind": kind, "backend": name, "median_ms": statistics.median(t) * 1e3,
                              "p90_ms": p90(sorted(t)) * 1e3, "steps": len(t)})
        except Exception as e:  # noqa: BLE001 - reported in the table
            steps.append({"kind": kind, "backend": "both", "error": f"{type(e).__name__}: {e}"[:300]})
    oks = [r["ok"] for r in rows]
    gathered = [None] * world
    dist.all_gather_object(gathered, oks)
    if rank == 0:
        for r, flags in zip(rows, zip(*gathered)):
            r["ok"] = all(flags)
        results.put((rows, steps))
    dist.barrier()
    dist.destroy_process_group()


def table(rows, steps, world: int, device_name: str) -> str:
    other = "nccl" if any(r["backend"] == "nccl" for r in rows) else "gloo"
    by = {(r["op"], r["bytes"], r["backend"]): r for r in rows}
    lines = [f"# P={world}, one GPU per rank ({device_name}); time per call in us as rank 0 sees it "
             f"(barrier, call, synchronize), median and p90; busbw GB/s with nccl-tests' factors",
             f"{'op':<15} {'bytes':>11} {'loom med':>10} {'loom p90':>10} {other + ' med':>10} "
             f"{other + ' p90':>10} {'loom/' + other:>10} {'loom bw':>8} {other + ' bw':>8} "
             f"{'bw ratio':>8} {'ok':>3}"]
    for op in dict.fromkeys(r["op"] for r in rows):
        for nbytes in sorted({r["bytes"] for r in rows if r["op"] == op}):
            a, b = by[(op, nbytes, "loom")], by[(op, nbytes, other)]
            bw = lambda r: nbytes / (r["median_us"] * 1e-6) / 1e9 * FACTOR[op](world)  # noqa: E731
            lines.append(f"{op:<15} {nbytes:>11} {a['median_us']:>10.1f} {a['p90_us']:>10.1f} "
                         f"{b['median_us']:>10.1f} {b['p90_us']:>10.1f} "
                         f"{a['median_us'] / b['median_us']:>9.2f}x {bw(a):>8.2f} {bw(b):>8.2f} "
                         f"{bw(a) / bw(b):>7.2f}x {'yes' if a['ok'] and b['ok'] else 'NO':>3}")
    for s in steps:
        if "error" in s:
            lines.append(f"# {s['kind']} {s['backend']}: {s['error']}")
        else:
            lines.append(f"# {s['kind']} step {s['backend']}: median {s['median_ms']:.2f} ms, "
                         f"p90 {s['p90_ms']:.2f} ms over {s['steps']} steps")
    return "\n".join(lines)


def plot(rows, world: int, device_name: str, path: str) -> None:
    """Time per call (left) and bus bandwidth (right) of each op, loom against the other."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    other = "nccl" if any(r["backend"] == "nccl" for r in rows) else "gloo"
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 2.6 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        for name, style in (("loom", "-o"), (other, "--s")):
            pts = sorted((r["bytes"], r["median_us"]) for r in rows if r["op"] == op and r["backend"] == name)
            x = [b for b, _ in pts]
            axes[i][0].plot(x, [t for _, t in pts], style, label=name, markersize=3)
            axes[i][1].plot(x, [b / (t * 1e-6) / 1e9 * FACTOR[op](world) for b, t in pts], style,
                            label=name, markersize=3)
        axes[i][0].set_ylabel(f"{op}\nus per call")
        axes[i][1].set_ylabel("busbw GB/s")
        for ax in axes[i]:
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
        axes[i][0].set_yscale("log")
        axes[i][0].legend(fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("bytes")
    fig.suptitle(f"loom vs {other}, P = {world}, one GPU per rank ({device_name})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--min-bytes", type=parse_bytes, default=8,
                        help="skip the grid's sizes below this (8, 32, 128, ... bytes)")
    parser.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("1G"))
    parser.add_argument("--factor", type=int, default=4,
                        help="each size of the grid this many times the one before")
    parser.add_argument("--ops", nargs="+", default=OPS)
    parser.add_argument("--budget", type=float, default=0.2, help="seconds per point and backend")
    parser.add_argument("--train", nargs="*", default=["ddp", "fsdp2"])
    parser.add_argument("--steps", type=int, default=30,
                        help="timed training steps per backend, taken in turns (ten swung DDP's "
                             "loom/NCCL ratio from 1.01x to 1.19x between calls on four H200s)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", default=None)
    parser.add_argument("--timeout", type=float, default=900, help="seconds for a whole P")
    parser.add_argument("--plot", default=None, metavar="JSON",
                        help="only draw JSON (a file --out wrote) as a PNG beside it, and exit")
    args = parser.parse_args()
    if args.plot:
        with open(args.plot) as f:
            saved = json.load(f)
        world = saved.get("world") or int(re.search(r"_p(\d+)", args.plot).group(1))
        plot(saved["rows"], world, saved["device"], args.plot.rsplit(".", 1)[0] + ".png")
        return 0
    keep_nvls_off()
    ctx = mp.get_context("spawn")
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU dry run"
    failed = False
    for world in args.ranks:
        if args.device == "cuda" and world > torch.cuda.device_count():
            print(f"P={world}: only {torch.cuda.device_count()} GPUs here; skipped")
            continue
        port = free_port()
        results = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(r, world, port, args, results)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            rows, steps = results.get(timeout=args.timeout)
        except Exception:  # noqa: BLE001 - a rank failed or hung: say so, end the rest
            print(f"P={world}: no results within {args.timeout} s", flush=True)
            for p in procs:
                p.kill()
            return 1
        for p in procs:
            p.join()
        text = table(rows, steps, world, name)
        print(text, flush=True)
        failed |= not all(r["ok"] for r in rows)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"cuda_vs_nccl_p{world}.json"), "w") as f:
                json.dump({"rows": rows, "steps": steps, "device": name, "world": world}, f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
