"""loom's CUDA collectives issued eagerly against the same calls captured in a CUDA graph and
replayed, several ranks sharing one GPU: time per call (a barrier, `iters` calls or one
replay of a graph holding `iters` calls, a stream synchronize, as seen from Python on rank
0), median and p90 of several repeats. Captured calls wait for their peers with a spinning
one-thread kernel where eager calls let the GPU's front end wait (docs/ARCHITECTURE.md, "CUDA
graphs"): this measures what that costs and what replaying saves in launch overhead. Results
are checked after every repeat.

    python tests/cuda/bench_graphs.py --ranks 2 4 --out DIR
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

SIZES = [8, 64 << 10, 1 << 20, 16 << 20]


def issue(op: str, x: torch.Tensor, out: torch.Tensor, iters: int) -> None:
    for _ in range(iters):
        if op == "all_reduce":
            x.fill_(1.0)
            dist.all_reduce(x)
        else:
            dist.all_gather_into_tensor(out, x)


def check(op: str, x: torch.Tensor, out: torch.Tensor, world: int) -> int:
    """How many output elements are wrong (inputs are ones)."""
    got, want = (x, float(world)) if op == "all_reduce" else (out, 1.0)
    return int((got != want).sum().item())


def timed(run) -> float:
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def worker(rank: int, world: int, port: int, args, queue) -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("cpu:loom,cuda:loom", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300), device_id=dev)
    rows = []
    for op in args.ops:
        for size in SIZES:
            n = max(1, size // 4)
            x = torch.ones(n, device=dev)
            out = torch.empty(n * world, device=dev)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                issue(op, x, out, 1)  # warm-up, as torch's CUDA graph notes ask
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                issue(op, x, out, args.iters)
            wrong = 0
            eager, replayed = [], []
            for _ in range(args.repeats):
                eager.append(timed(lambda: issue(op, x, out, args.iters)) / args.iters * 1e6)
                wrong += check(op, x, out, world)
                out.zero_()
                replayed.append(timed(graph.replay) / args.iters * 1e6)
                wrong += check(op, x, out, world)
            del graph
            if rank == 0:
                rows.append((op, size, sorted(eager), sorted(replayed), wrong))
                e, r = statistics.median(eager), statistics.median(replayed)
                print(f"P={world} {op:<11} {size:>9} B eager {e:9.1f} us  replayed {r:9.1f} us  "
                      f"#wrong {wrong}", flush=True)
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def p90(s: list[float]) -> float:
    return nearest_rank_p90(s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--ops", nargs="+", default=["all_reduce", "all_gather"])
    parser.add_argument("--iters", type=int, default=20, help="calls per timed run (and per graph)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = []
    for world in args.ranks:
        rows = run_spawned(worker, world, args, timeout=1200)
        lines.append(f"# P={world} ranks on one GPU ({torch.cuda.get_device_name(0)}); time per call "
                     f"in us, {args.iters} calls per run, {args.repeats} runs")
        lines.append(f"{'op':<11} {'bytes':>9} {'eager med':>10} {'eager p90':>10} {'graph med':>10} "
                     f"{'graph p90':>10} {'eager/graph':>11} {'wrong':>5}")
        for op, size, eager, replayed, wrong in rows:
            e, r = statistics.median(eager), statistics.median(replayed)
            lines.append(f"{op:<11} {size:>9} {e:10.1f} {p90(eager):10.1f} {r:10.1f} {p90(replayed):10.1f} "
                         f"{e / r:11.2f} {wrong:5d}")
    report(lines, args.out, "cuda_graphs_bench.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
