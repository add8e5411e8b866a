"""Where a DDP or FSDP2 training step's time goes with one GPU per rank, loom against NCCL:
bench_nccl.py's model and step under torch's profiler, rank 0's CPU time per operator (the
collectives' host path, the waits) and the step times, for each backend in the same
processes.

    python3 tests/cuda/train_profile_probe.py [--ranks 2] [--kind fsdp2] [--steps 10]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import loom  # noqa: F401  (registers the backend)
from spawned import report, run_spawned


def build(kind: str, group, dev):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2560, 2560) for _ in range(4)]).to(dev)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, process_group=group, device_ids=[dev.index])
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    mesh = DeviceMesh.from_group(group, "cuda")
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def worker(rank: int, world: int, port: int, args, queue) -> None:
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    groups = {"loom": dist.new_group(backend="loom"), "nccl": dist.new_group(backend="nccl")}
    lines = []
    for name, group in groups.items():
        model = build(args.kind, group, dev)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(64, 2560, device=dev)

        def step():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            torch.cuda.synchronize()

        for _ in range(5):
            step()
        times = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                dist.barrier(group=group)
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
        if rank == 0:
            lines.append(f"# {name}: {args.kind} step median {statistics.median(times) * 1e3:.2f} ms "
                         f"over {args.steps} profiled steps (P={world}, "
                         f"{torch.cuda.get_device_name(dev)})")
            lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        del model, opt
        torch.cuda.empty_cache()
    if rank == 0:
        queue.put(lines)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--kind", choices=["ddp", "fsdp2"], default="fsdp2")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    report(run_spawned(worker, args.ranks, args, timeout=300), None, "")


if __name__ == "__main__":
    main()
