"""loom vs Gloo through torch.distributed, side by side in one run.

    python -m loom.bench                      # 2 ranks, 8 B .. 256 MiB, five collectives
    python -m loom.bench --ranks 4 --max-bytes 64M --ops all_reduce,all_gather_into_tensor
    python -m loom.bench --ddp-step           # also time a DDP training step (~100M params)
    python -m loom.bench --fsdp-step          # and an FSDP2 transformer step (127M params)
    python -m loom.bench --ranks 4 --ops all_reduce --backends loom,direct,fake,gloo --max-bytes 1M
    python -m loom.bench --ranks 8 --hosts 2 --link-gbit 10   # 2 namespace hosts (root)
    python -m loom.bench --ranks 4 --max-bytes 4M --trace      # and where each call's time went
    python -m loom.bench --ranks 4 --max-bytes 16M --repeats 3  # steady? three sweeps back to back
    torchrun --nnodes 2 --nproc-per-node 4 ... -m loom.bench  # across real machines

Each rank joins a loom default group and a Gloo group over the same ranks. For every op and
size, the backends run the same call (`direct`: loom's torch.ops.loom operator on the loom
group, skipping c10d, with a one-element all_reduce of that operator as its barrier; `eager`:
the same through loom.ops's eager functions, which also skip torch's dispatcher; `fake`:
torch's no-op backend, the floor of any c10d call): a barrier, then the timed call, as seen
from Python on rank 0 (as tests/cuda/bench_nccl.py times NCCL, docs/PERFORMANCE.md); the median and
the 90th percentile of several calls after warm-ups are reported (with --repeats N, the
whole sweep runs N times back to back and each point reports the median of the sweeps'
medians and p90s). Every table ends with a steadiness report: the points whose sweeps'
medians disagree by more than 25%, and the cliffs, sizes whose median is over 1.2x the next
larger size's (the CPU issue's bars). Output: a table with the Gloo/loom
time ratio per size, a PNG plot of bus bandwidth, and the raw numbers as JSON (--out, default
./bench-out). The host's copy bandwidth is measured in the same run and printed above the
table, to compare large sizes' bus bandwidth with. Across hosts (--hosts on this machine, or under torchrun on several), the
table also gives each host's link rate: busbw counted over hosts (the nccl-tests factor with
P = hosts).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue as queue_module
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

from ._backend_names import gloo_replaced
from ._stats import p90

OPS = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single"]
# Asked for by name only (not in the default sweep): rank r sends its buffer to rank r ^ 1
# and receives that rank's in one batch_isend_irecv (an odd last rank idles), as pipeline
# stages pass activations; timed through c10d only (the direct entry has no send/recv).
P2P_OPS = ["send_recv"]

# busbw = algbw x factor (nccl-tests); size conventions follow nccl-tests as well.
BUS_FACTOR = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "all_gather_into_tensor": lambda p: (p - 1) / p,
    "reduce_scatter_tensor": lambda p: (p - 1) / p,
    "all_to_all_single": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "send_recv": lambda p: 1.0,
}


def parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    digits = text.rstrip("KMGB")
    suffix = text[len(digits):].rstrip("B") or ""
    if not digits.isdigit() or suffix not in units:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size like 8, 64K, 1M or 256M")
    return int(digits) * units[suffix]


def human(n: float) -> str:
    for unit in ["B", "KiB", "MiB", "GiB"]:
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return str(n)


def sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def calls_for(nbytes: int) -> int:
    """Timed calls per point: more for small messages, fewer for huge ones."""
    if nbytes <= 1 << 16:
        return 40
    if nbytes <= 1 << 22:
        return 15
    return 5


def _renamed(module, name: str, old_name: str):
    """`module.name`, or `module.old_name` on a torch that predates the rename (torch 2.13
    deprecates all_gather_into_tensor and reduce_scatter_tensor for the *_single names, which
    torch 2.11 lacks)."""
    return getattr(module, name, None) or getattr(module, old_name)


def direct_ops(backend: str):
    """The namespace of loom's direct entry that `backend` times: torch.ops.loom ("direct")
    or loom.ops's eager functions ("eager"); None for the c10d backends."""
    import torch

    if backend == "direct":
        return torch.ops.loom
    if backend == "eager":
        import loom.ops

        return loom.ops
    return None


def make_case(op: str, nbytes: int, world: int, rank: int, backend: str = "loom"):
    """Tensors for one call of `op` moving `nbytes` (nccl-tests convention) and the call:
    torch.distributed's on the group it is given, or for `backend` "direct" loom's torch
    operator on that group (python/loom/ops.py; the gather, reduce-scatter and all-to-all
    write into a tensor made once, through their *_out forms, as the c10d calls do: the forms
    that return a new tensor would add its allocation to every call), for "eager" the same
    through loom.ops's eager functions."""
    import torch
    import torch.distributed as dist

    elems = max(1, nbytes // 4)
    ops = direct_ops(backend)
    direct = ops is not None
    if op == "all_reduce":
        t = torch.ones(elems)
        if direct:
            return lambda g: ops.all_reduce_(t, "sum", g.group_name)
        return lambda g: dist.all_reduce(t, group=g)
    if op == "broadcast":
        t = torch.ones(elems)
        if direct:
            return lambda g: ops.broadcast_(t, 0, g.group_name)
        return lambda g: dist.broadcast(t, src=0, group=g)
    if op == "send_recv":
        mine, theirs = torch.ones(elems), torch.empty(elems)
        return lambda g: exchange(mine, theirs, g)
    per = max(1, elems // world)
    if op == "all_gather_into_tensor":
        out, inp = torch.empty(per * world), torch.ones(per)
        if direct:
            return lambda g: ops.all_gather_into_tensor_out(inp, world, g.group_name, out=out)
        gather = _renamed(dist, "all_gather_single", "all_gather_into_tensor")
        return lambda g: gather(out, inp, group=g)
    if op == "reduce_scatter_tensor":
        out, inp = torch.empty(per), torch.ones(per * world)
        if direct:
            return lambda g: ops.reduce_scatter_tensor_out(inp, "sum", world, g.group_name, out=out)
        reduce_scatter = _renamed(dist, "reduce_scatter_single", "reduce_scatter_tensor")
        return lambda g: reduce_scatter(out, inp, group=g)
    if op == "all_to_all_single":
        out, inp = torch.empty(per * world), torch.ones(per * world)
        if direct:
            return lambda g: ops.all_to_all_single_out(inp, [], [], g.group_name, out=out)
        return lambda g: dist.all_to_all_single(out, inp, group=g)
    raise ValueError(op)


def exchange(mine, theirs, group) -> None:
    """Sends `mine` to this rank's partner (rank ^ 1 within `group`) and receives the
    partner's into `theirs`, in one batch_isend_irecv; a last rank without one returns."""
    import torch.distributed as dist

    me = dist.get_rank(group)
    if me ^ 1 >= dist.get_world_size(group):
        return
    peer = dist.get_global_rank(group, me ^ 1)
    ops = [dist.P2POp(dist.isend, mine, peer, group), dist.P2POp(dist.irecv, theirs, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def case_bytes(op: str, nbytes: int, world: int) -> int:
    elems = max(1, nbytes // 4)
    if op in ("all_reduce", "broadcast", "send_recv"):
        return elems * 4
    return max(1, elems // world) * world * 4


def time_calls(call, group, barrier, n: int, warmup: int = 3) -> tuple[float, float]:
    """Median and 90th percentile seconds of `n` calls, each after `barrier()`."""
    for _ in range(warmup):
        call(group)
    samples = []
    for _ in range(n):
        barrier()
        t0 = time.perf_counter()
        call(group)
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return statistics.median(samples), p90(samples)


def barrier_for(backend: str, group):
    """The barrier before each timed call: the backend's own. For torch.ops.loom that is a
    one-element all_reduce through the same operator, as DeepSpeed's benchmark uses its own
    shm all_reduce (scripts/anchors/run.sh runs it): a c10d barrier would add its exit skew
    to the call."""
    import torch
    import torch.distributed as dist

    ops = direct_ops(backend)
    if ops is not None:
        one = torch.zeros(1)
        return lambda: ops.all_reduce_(one, "sum", group.group_name)
    return lambda: dist.barrier(group=group)


def copy_bandwidth(nbytes: int) -> float:
    """Bytes read + written per second when every rank copies `nbytes` at once."""
    import torch
    import torch.distributed as dist

    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    samples = []
    for _ in range(6):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(elapsed.item())
    return 2 * nbytes * dist.get_world_size() / statistics.median(samples[1:])


def ddp_layers(params_millions: float, width: int) -> int:
    """Layers of the DDP model: as many width x width layers as make the parameter count."""
    return max(1, round(params_millions * 1e6 / (width * width)))


def ddp_model(kind: str, params_millions: float, width: int):
    """The DDP benchmark's model and a function making its input for a batch.
    "mlp": width x width layers (ddp_layers of them) with ReLUs, compute growing with the
    batch. "embedding": a token embedding table of about `params_millions` million
    parameters (width-wide rows) under one width x width layer, as a language model's input
    table or a recommender's: a step touches a few rows but its gradient is the whole table
    (dense, as DDP all-reduces it), so communication is most of the step."""
    import torch
    import torch.nn as nn

    if kind == "mlp":
        layers = ddp_layers(params_millions, width)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])
        return model, lambda batch: torch.randn(batch, width)
    rows = max(1, round(params_millions * 1e6 / width))
    model = nn.Sequential(nn.Embedding(rows, width), nn.Linear(width, width))
    return model, lambda batch: torch.randint(0, rows, (batch,))


def ddp_step_times(groups: dict, params_millions: float, width: int, batch: int, steps: int,
                   kind: str = "mlp", bucket_view: bool = False) -> tuple[dict, int]:
    """Median and 90th-percentile seconds of one DDP training step (forward, backward,
    gradient all_reduce, optimizer step) of ddp_model(kind, ...) at `batch` samples per rank,
    on each group of `groups` ({backend: group}); with `bucket_view`, DDP's
    gradient_as_bucket_view (gradients live in its buckets: no copy in and out).
    The backends take turns step by step (one model each, built alike), so a swing of a
    shared host falls on all of them rather than on whichever ran last. Also returns the
    model's parameter count."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    runs, parameters = {}, 0
    for backend, group in groups.items():
        torch.manual_seed(0)
        module, make_input = ddp_model(kind, params_millions, width)
        parameters = sum(p.numel() for p in module.parameters())
        model = DDP(module, process_group=group, gradient_as_bucket_view=bucket_view)
        runs[backend] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
    torch.manual_seed(1)
    x = make_input(batch)
    samples = {backend: [] for backend in groups}
    for step in range(steps + 2):  # two warm-up steps each
        for backend, (model, opt) in runs.items():
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            model(x).sum().backward()
            opt.step()
            if step >= 2:
                samples[backend].append(time.perf_counter() - t0)
    times = {}
    for backend, s in samples.items():
        s.sort()
        times[backend] = {"median": statistics.median(s), "p90": p90(s)}
    return times, parameters


def fsdp_step_time(group, params_millions: int, tokens: int, steps: int,
                   from_group: bool) -> tuple[float, int]:
    """Median seconds of one FSDP2 training step, and the model's parameter count: a step (forward, backward, optimizer step) of a
    transformer whose encoder layers (width 768, 12 heads, feed-forward 3072) and 32000-token
    embedding hold about `params_millions` million parameters (the output projection, as
    large as the embedding, comes on top: 127M in all for 100), `tokens` tokens per rank,
    every module sharded with fully_shard over `group`; `from_group`: FSDP's communication
    buffers come from the group's allocate_tensor
    (set_allocate_memory_from_process_group_for_comm)."""
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    width, vocab = 768, 32000
    per_layer = 12 * width * width + 13 * width  # attention 4 w^2, feed-forward 8 w^2, biases, norms
    layers = max(1, round((params_millions * 1e6 - vocab * width) / per_layer))
    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    blocks = [nn.TransformerEncoderLayer(width, 12, 4 * width, dropout=0.0, batch_first=True)
              for _ in range(layers)]
    model = nn.Sequential(nn.Embedding(vocab, width), *blocks, nn.Linear(width, vocab))
    parameters = sum(p.numel() for p in model.parameters())
    for module in model:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in (*model, model):  # the setting is per fully_shard module
        module.set_allocate_memory_from_process_group_for_comm(from_group)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(group.rank())
    x = torch.randint(0, vocab, (1, tokens), generator=g)
    samples = []
    for step in range(steps + 2):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
        if step >= 2:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples), parameters


def rank_main(rank: int, world: int, args, init_method: str, queue, hosts=None) -> None:
    """One rank: joins loom and Gloo groups, times every point, and hands rank 0's results to
    `queue` (or, without one, returns them). With `hosts` (namespace hosts on this machine)
    the rank first moves into its host, ranks placed host by host."""
    try:
        if hosts is not None:
            hosts.enter(rank // (world // len(hosts.names)))
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["LOOM_NET_IFNAME"] = "eth0"
        import torch
        import torch.distributed as dist

        import loom  # noqa: F401

        # Ranks on this machine share the cores it may use (its CPU set: taskset, SLURM and
        # containers give fewer than os.cpu_count(); namespace hosts included).
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // local))
        dist.init_process_group("loom", init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(minutes=10))
        groups = {"loom": dist.group.WORLD, "direct": dist.group.WORLD, "eager": dist.group.WORLD}
        # Each other backend only where asked for (the fake group is torch's no-op backend:
        # what any c10d call costs before a backend does anything).
        if "fake" in args.backends:
            import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
        for other in ("gloo", "fake"):
            if other in args.backends:
                groups[other] = dist.new_group(backend=other)
        copy_bw = copy_bandwidth(min(args.max_bytes, 256 << 20) if args.max_bytes >= 64 << 20 else 64 << 20)
        # Sizes below one element per rank round up to the same call: time each call once.
        points = []
        for op in args.ops:
            seen = set()
            for s in sizes(args.min_bytes, args.max_bytes):
                if case_bytes(op, s, world) not in seen:
                    seen.add(case_bytes(op, s, world))
                    points.append((op, s))
        bar = None
        if rank == 0 and not args.quiet:
            try:
                from tqdm import tqdm

                bar = tqdm(total=len(points) * len(args.backends) * args.repeats, unit="point",
                           file=sys.stderr)
            except ImportError:
                bar = None
        # Whole sweeps back to back: a slow spell that lasts a while shows as sweeps that
        # disagree, where repeating each point at once would hide it.
        sweeps = []
        for sweep in range(args.repeats):
            rows = []
            for op, nbytes in points:
                row = {"op": op, "bytes": case_bytes(op, nbytes, world), "ranks": world}
                for backend in args.backends:
                    call = make_case(op, nbytes, world, rank, backend)
                    row[backend], row[backend + "_p90"] = time_calls(
                        call, groups[backend], barrier_for(backend, groups[backend]), calls_for(nbytes))
                    if bar is not None:
                        bar.set_description(f"{op} {human(nbytes)} {backend}"
                                            + (f" (sweep {sweep + 1}/{args.repeats})" if args.repeats > 1 else ""))
                        bar.update()
                rows.append(row)
            sweeps.append(rows)
        results = merge_sweeps(sweeps, args.backends)
        if bar is not None:
            bar.close()
        ddp, ddp_parameters = {}, 0
        if args.ddp_step:
            stepped = {b: groups[b] for b in args.backends if b in ("loom", "gloo")}
            for batch in args.ddp_batch:
                ddp[str(batch)], ddp_parameters = ddp_step_times(
                    stepped, args.ddp_params, args.ddp_width, batch, args.ddp_steps, args.ddp_model,
                    args.ddp_bucket_view)
        fsdp, fsdp_parameters = {}, 0
        if args.fsdp_step:
            runs = [("loom", "loom", False), ("loom allocate_tensor", "loom", True), ("gloo", "gloo", False)]
            for name, backend, from_group in runs:
                if backend in args.backends:
                    fsdp[name], fsdp_parameters = fsdp_step_time(
                        groups[backend], args.fsdp_params, args.fsdp_tokens, args.fsdp_steps, from_group)
        dist.barrier()
        dist.destroy_process_group()
        data = {"results": results, "copy_bw": copy_bw, "ddp": ddp, "fsdp": fsdp,
                "ddp_parameters": ddp_parameters,
                "fsdp_parameters": fsdp_parameters,
                "torch_threads": torch.get_num_threads(),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}
        if queue is None:
            return data
        queue.put((rank, "ok", data))
    except BaseException:  # noqa: BLE001
        if queue is None:
            raise
        queue.put((rank, "error", traceback.format_exc()))
    return None


def merge_sweeps(sweeps: list[list[dict]], backends: list[str]) -> list[dict]:
    """One row per point: each backend's median and p90 are the medians of the sweeps' (so
    one slow sweep does not move them), and `<backend>_sweeps` lists every sweep's median."""
    merged = []
    for rows in zip(*sweeps):
        row = {k: v for k, v in rows[0].items() if k not in backends and not k.endswith("_p90")}
        for b in backends:
            row[b] = statistics.median(r[b] for r in rows)
            row[b + "_p90"] = statistics.median(r[b + "_p90"] for r in rows)
            row[b + "_sweeps"] = [r[b] for r in rows]
        merged.append(row)
    return merged


def steadiness(results: list[dict], backends: list[str], agree: float = 1.25, cliff: float = 1.2) -> list[str]:
    """The steadiness report on merge_sweeps' rows: per backend, the points whose sweeps'
    medians differ by more than `agree` (largest over smallest), and the cliffs, points whose
    median is more than `cliff` times that of the next larger size of the same op."""
    rule = f"over {cliff:.1f}x the next larger size's"
    lines = []
    for b in backends:
        unsteady, cliffs, points = [], [], 0
        for op in dict.fromkeys(r["op"] for r in results):
            rows = sorted((r for r in results if r["op"] == op), key=lambda r: r["bytes"])
            for r, larger in zip(rows, rows[1:] + [None]):
                points += 1
                runs = r[b + "_sweeps"]
                if max(runs) > agree * min(runs):
                    unsteady.append(f"{op} {human(r['bytes'])} ({', '.join(f'{t * 1e6:.1f}' for t in runs)} us)")
                if larger is not None and r[b] > cliff * larger[b]:
                    cliffs.append(f"{op} {human(r['bytes'])} ({r[b] * 1e6:.1f} us against "
                                  f"{larger[b] * 1e6:.1f} at {human(larger['bytes'])})")
        sweeps = len(results[0][b + "_sweeps"]) if results else 0
        if sweeps > 1:
            lines.append(f"{b}: the {sweeps} sweeps' medians agree within {agree - 1:.0%} at "
                         f"{points - len(unsteady)} of {points} points"
                         + (f"; not at {'; '.join(unsteady)}" if unsteady else ""))
        lines.append(f"{b}: {len(cliffs)} cliff{'' if len(cliffs) == 1 else 's'} (a median {rule}): "
                     + "; ".join(cliffs) if cliffs else f"{b}: no cliffs (no median {rule})")
    return lines


def print_table(results, backends, world, copy_bw, hosts: int = 1) -> list[str]:
    where = f"{world} ranks" + (f" on {hosts} hosts" if hosts > 1 else "")
    lines = [f"# {where}; copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write, all ranks copying at once)",
             "# us: median time per call; p90: its 90th percentile; GB/s: bus bandwidth (nccl-tests)"
             + ("; host GB/s: busbw counted over hosts, each host's link rate" if hosts > 1 else "")]
    for op in dict.fromkeys(r["op"] for r in results):
        lines.append("")
        lines.append(f"## {op}")
        head = f"{'size':>12} "
        for b in backends:
            head += f"{b + ' us':>12} {'p90':>9} {b + ' GB/s':>11} " + (f"{'host GB/s':>10} " if hosts > 1 else "")
        if "loom" in backends and "gloo" in backends:
            head += f"{'gloo/loom':>10}"
        lines.append(head)
        for r in (r for r in results if r["op"] == op):
            line = f"{human(r['bytes']):>12} "
            for b in backends:
                algbw = r["bytes"] / r[b] / 1e9
                line += f"{r[b] * 1e6:12.1f} {r.get(b + '_p90', r[b]) * 1e6:9.1f} {algbw * BUS_FACTOR[op](world):11.3f} "
                if hosts > 1:
                    line += f"{algbw * BUS_FACTOR[op](hosts):10.3f} "
            if "loom" in backends and "gloo" in backends:
                line += f"{r['gloo'] / r['loom']:9.1f}x"
            lines.append(line)
    return lines


def plot(results, backends, world, path: Path, hosts: int = 1) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ops = list(dict.fromkeys(r["op"] for r in results))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.8), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [r for r in results if r["op"] == op]
        for b in backends:
            ax.plot([r["bytes"] for r in rows], [r["bytes"] / r[b] * BUS_FACTOR[op](world) / 1e9 for r in rows],
                    marker="o", markersize=3, label=b)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("bytes")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("bus bandwidth (GB/s)")
    axes[0][0].legend()
    where = f"{world} ranks" + (f" on {hosts} hosts" if hosts > 1 else "")
    fig.suptitle(f"loom vs Gloo through torch.distributed, {where}, CPU tensors")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loom.bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--ranks", type=int, default=2, help="ranks to run on this host (default 2)")
    parser.add_argument("--min-bytes", type=parse_size, default=8, help="smallest size (default 8)")
    parser.add_argument("--max-bytes", type=parse_size, default=256 << 20, help="largest size (default 256M)")
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"comma-separated subset of {', '.join(OPS)} (the default), or send_recv")
    parser.add_argument("--backends", default="loom,gloo",
                        help="comma-separated: loom, gloo, direct (loom's torch.ops.loom operators), "
                             "eager (the same through loom.ops, without torch's dispatcher), "
                             "fake (torch's no-op backend: the floor of any c10d call)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per rank (default: this machine's cores shared among its ranks)")
    parser.add_argument("--ddp-step", action="store_true", help="also time a DDP training step")
    parser.add_argument("--ddp-params", type=float, default=100, help="DDP model size in millions of parameters")
    parser.add_argument("--ddp-width", type=int, default=2048, help="width of the DDP model's square layers")
    parser.add_argument("--ddp-model", choices=("mlp", "embedding"), default="mlp",
                        help="mlp: square layers, compute grows with the batch; embedding: a token table "
                             "(dense gradient of the whole table each step) under one layer, communication-bound")
    parser.add_argument("--ddp-bucket-view", action="store_true",
                        help="DDP's gradient_as_bucket_view=True (no gradient copies into its buckets)")
    parser.add_argument("--ddp-steps", type=int, default=5, help="timed DDP steps per backend")
    parser.add_argument("--ddp-batch", type=lambda v: [int(b) for b in v.split(",")], default=[32],
                        help="comma-separated samples per rank, one DDP run each (default 32; smaller batches "
                             "leave the step more to communication)")
    parser.add_argument("--fsdp-step", action="store_true",
                        help="also time an FSDP2 transformer step (127M parameters by default): loom with and without "
                             "allocate_tensor, and Gloo")
    parser.add_argument("--fsdp-params", type=int, default=100, help="FSDP2 model size in millions of parameters")
    parser.add_argument("--fsdp-tokens", type=int, default=64,
                        help="tokens per rank per FSDP2 step (few: communication-bound)")
    parser.add_argument("--fsdp-steps", type=int, default=5, help="timed FSDP2 steps")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="where the table, plot and JSON go")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--hosts", type=int, default=1,
                        help="place the ranks on this many hosts made of network namespaces on this "
                             "machine, host by host (needs root and iproute2)")
    parser.add_argument("--link-gbit", type=float, default=0,
                        help="with --hosts: limit each host's link to this many Gb/s each way (tc tbf)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the whole sweep this many times back to back; each point reports the "
                             "median of the sweeps' medians, and the steadiness report says where they "
                             "disagree by more than 25%%")
    parser.add_argument("--trace", action="store_true",
                        help="also record every rank's timeline (LOOM_TRACE) in OUT/trace/ and write where "
                             "each collective's time went to OUT/trace.txt (python -m loom.trace)")
    args = parser.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    args.backends = [b for b in args.backends.split(",") if b]
    check_choices(parser, args)
    for op in args.ops:
        if op not in OPS + P2P_OPS:
            parser.error(f"unknown op '{op}'; choose from {', '.join(OPS + P2P_OPS)}")
        if op in P2P_OPS and {"direct", "eager"} & set(args.backends):
            parser.error(f"{op} is timed through torch.distributed only; leave direct and eager "
                         "out of --backends for it")
    for b in args.backends:
        if b not in ("loom", "gloo", "direct", "eager", "fake"):
            parser.error(f"unknown backend '{b}'")
    if "gloo" in args.backends and gloo_replaced():
        parser.error("Gloo is measured here, but LOOM_REPLACES_GLOO is set, so a group asked for "
                     "as 'gloo' would run on loom: unset it, or leave gloo out of --backends")
    if args.ranks < 1 or args.min_bytes < 1 or args.min_bytes > args.max_bytes:
        parser.error("need --ranks >= 1 and 1 <= --min-bytes <= --max-bytes")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.hosts < 1 or args.ranks % args.hosts != 0:
        parser.error("--hosts must divide --ranks")
    if args.link_gbit and args.hosts == 1:
        parser.error("--link-gbit needs --hosts")
    if not math.isfinite(args.link_gbit) or args.link_gbit < 0 or 0 < args.link_gbit < 1e-3:
        parser.error("--link-gbit must be 0 (no limit) or at least 0.001 Gb/s (what tc can set)")
    if args.threads < 0:
        parser.error("--threads must be at least 1 (0: the machine's cores shared among its ranks)")
    for flag, steps, asked in (("--ddp-steps", args.ddp_steps, args.ddp_step),
                               ("--fsdp-steps", args.fsdp_steps, args.fsdp_step)):
        if asked and steps < 1:
            parser.error(f"{flag} must be at least 1 (a median needs a step)")

    trace_prefix = None
    if args.trace:
        # Set before any rank starts: loom reads LOOM_TRACE once per process.
        trace_prefix = (args.out / "trace" / "rank").resolve()
        for old in trace_prefix.parent.glob("rank.*.json"):
            old.unlink()  # an earlier run's files would mix in
        os.environ["LOOM_TRACE"] = str(trace_prefix)
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return run_under_torchrun(args)
    hosts = None
    if args.hosts > 1:
        from loom import _netns

        reason = _netns.unavailable_reason()
        if reason:
            parser.error(f"--hosts: {reason}")
        hosts = _netns.NamespaceHosts(args.hosts)
    try:
        for h in range(args.hosts if args.link_gbit else 0):
            hosts.shape(h, args.link_gbit)
        data = run_forked(args, hosts)
    finally:
        if hosts is not None:
            hosts.close()
    if data is None:
        return 1
    report(data, args, args.ranks, args.hosts)
    if trace_prefix is not None:
        # Every rank has ended (and written its timeline) by now.
        from loom.trace import summary

        (args.out / "trace.txt").write_text("\n".join(summary(trace_prefix)) + "\n")
        print(f"where the time went, per rank and size: {args.out / 'trace.txt'} "
              f"(timelines for https://ui.perfetto.dev: {trace_prefix.parent})")
    return 0


def check_choices(parser, args) -> None:
    """Refuses (parser.error) lists that name nothing, and training steps that none of the
    backends asked for can time (DDP and FSDP2 run on the loom and Gloo groups only)."""
    if not args.ops:
        parser.error(f"--ops names no op; choose from {', '.join(OPS + P2P_OPS)}")
    if not args.backends:
        parser.error("--backends names no backend; choose from loom, gloo, direct, eager, fake")
    stepping = [flag for flag, on in (("--ddp-step", args.ddp_step), ("--fsdp-step", args.fsdp_step)) if on]
    if stepping and not {"loom", "gloo"} & set(args.backends):
        parser.error(f"{' and '.join(stepping)}: the training steps run on the loom and Gloo groups only; "
                     f"add loom or gloo to --backends (now {','.join(args.backends)})")


def run_forked(args, hosts) -> dict | None:
    """Forks the ranks; returns rank 0's results, or None (after printing why) if any failed."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'init')}"
        procs = [ctx.Process(target=rank_main, args=(r, args.ranks, args, init, queue, hosts))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        outcome = {}
        while len(outcome) < len(procs):
            try:
                rank, status, payload = queue.get(timeout=1.0)
                outcome[rank] = (status, payload)
            except queue_module.Empty:
                # A rank that died (SIGKILL, the OOM killer, a crash) never reports: say so
                # once its peers have reported, instead of waiting for it forever.
                dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode is not None]
                if dead and all(r in outcome or r in dead for r in range(len(procs))):
                    for r in dead:
                        outcome[r] = ("failed", f"rank {r} exited with code {procs[r].exitcode} "
                                                f"before reporting (a negative code is the signal "
                                                f"that ended it)")
        for p in procs:
            p.join()
    failed = {r: p for r, (s, p) in outcome.items() if s != "ok"}
    for r, text in sorted(failed.items()):
        print(f"--- rank {r} failed ---\n{text}", file=sys.stderr)
    return None if failed else outcome[0][1]


def run_under_torchrun(args) -> int:
    """This process is one rank of a torchrun job (on one machine or several): rank 0 reports."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosts = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
    data = rank_main(rank, world, args, "env://", None)
    if rank == 0:
        report(data, args, world, hosts)
        if args.trace:  # the other ranks may still be writing theirs: summarise afterwards
            print(f"timelines: {os.environ['LOOM_TRACE']}.<pid>.json on each machine; "
                  f"python -m loom.trace {os.environ['LOOM_TRACE']} summarises them")
    return 0


def report(data: dict, args, world: int, hosts: int) -> None:
    """Prints the table and writes it, the JSON and the plot to --out."""
    lines = print_table(data["results"], args.backends, world, data["copy_bw"], hosts)
    # What the ranks' torch threads did between calls changes the numbers (docs/PERFORMANCE.md,
    # "Where loom falls short"): every table says.
    policy = data["omp_wait_policy"] or "unset (torch's OpenMP threads spin after each op)"
    lines.insert(2, f"# torch threads per rank: {data['torch_threads']}; OMP_WAIT_POLICY: {policy}")
    lines += ["", "## steadiness"] + steadiness(data["results"], args.backends)
    for batch, times in data["ddp"].items():
        lines.append("")
        model = ("MLP" if args.ddp_model == "mlp" else "embedding table and one layer")
        view = ", gradient_as_bucket_view" if args.ddp_bucket_view else ""
        lines.append(f"## DDP training step, {model} of {data['ddp_parameters'] / 1e6:.3g}M parameters "
                     f"({args.ddp_width}-wide), batch {batch} per rank{view}, "
                     f"{world} ranks, {args.ddp_steps} steps per backend taken in turns")
        for b, t in times.items():
            lines.append(f"{b:>6}: {t['median'] * 1e3:9.1f} ms per step (median), p90 {t['p90'] * 1e3:.1f}")
        if "loom" in times and "gloo" in times:
            lines.append(f"gloo/loom: {times['gloo']['median'] / times['loom']['median']:.2f}x")
    if data.get("fsdp"):
        lines.append("")
        lines.append(f"## FSDP2 training step, transformer of {data['fsdp_parameters'] / 1e6:.0f}M parameters, "
                     f"{args.fsdp_tokens} tokens per rank, {world} ranks")
        for b, seconds in data["fsdp"].items():
            lines.append(f"{b:>21}: {seconds * 1e3:9.1f} ms per step")
        for b in ("loom", "loom allocate_tensor"):
            if b in data["fsdp"] and "gloo" in data["fsdp"]:
                lines.append(f"gloo/{b}: {data['fsdp']['gloo'] / data['fsdp'][b]:.2f}x")
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.txt").write_text("\n".join(lines) + "\n")
    meta = {"ranks": world, "hosts": hosts, "link_gbit": getattr(args, "link_gbit", 0)}
    (args.out / "results.json").write_text(json.dumps({**meta, **data}, indent=1))
    if plot(data["results"], args.backends, world, args.out / "busbw.png", hosts):
        print(f"\nplot: {args.out / 'busbw.png'}; numbers: {args.out / 'results.json'}")
    else:
        print(f"\nnumbers: {args.out / 'results.json'} (no plot: matplotlib is not installed; "
              f"pip install matplotlib, or loom's 'bench' extra, draws one)")


if __name__ == "__main__":
    sys.exit(main())
