"""Where a small DDP step's time goes: the step without DDP, with DDP on loom and on Gloo
(gradients copied into DDP's buckets, and as bucket views), and one all_reduce of the whole
gradient on each backend. Rank 0 prints medians (docs/PERFORMANCE.md, "DDP steps").

    python scripts/ddp_breakdown.py --ranks 2 [--width 512 --layers 4 --threads 1]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time


def rank_main(rank: int, args, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import loom  # noqa: F401  (registers the backend)

    torch.set_num_threads(args.threads)
    dist.init_process_group("loom", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    gloo = dist.new_group(backend="gloo")

    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU())
                               for _ in range(args.layers)])

    x = torch.randn(args.batch, args.width)

    def steps(m, label):
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        samples = []
        for _ in range(args.steps + 20):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            m(x).sum().backward()
            opt.step()
            samples.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"{label:>28}: {statistics.median(samples[20:]) * 1e3:8.2f} ms per step")

    steps(model(), "step without DDP")
    steps(DDP(model()), "DDP on loom")
    steps(DDP(model(), process_group=gloo), "DDP on Gloo")
    steps(DDP(model(), gradient_as_bucket_view=True), "DDP on loom, bucket views")
    steps(DDP(model(), process_group=gloo, gradient_as_bucket_view=True), "DDP on Gloo, bucket views")
    gradient = torch.zeros(sum(p.numel() for p in model().parameters()))
    for label, group in (("loom", None), ("Gloo", gloo)):
        samples = []
        for _ in range(100):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(gradient, group=group)
            samples.append(time.perf_counter() - t0)
        if rank == 0:
            print(f"{f'all_reduce of the gradient, {label}':>28}: {statistics.median(samples) * 1e3:8.2f} ms "
                  f"({gradient.numel() * 4 >> 10} KiB)")
    dist.destroy_process_group(gloo)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=512, help="the MLP's square layers")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1, help="samples per rank")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per variant")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    ranks = [ctx.Process(target=rank_main, args=(r, args, port)) for r in range(args.ranks)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join()
    return max(p.exitcode or 0 for p in ranks)


if __name__ == "__main__":
    raise SystemExit(main())
