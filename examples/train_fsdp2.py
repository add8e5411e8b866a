"""Fully sharded data-parallel training (FSDP2, fully_shard) of a small MLP on synthetic data,
through the loom backend.

    torchrun --nproc-per-node 4 examples/train_fsdp2.py [--steps 50]

Parameters are sharded across ranks; each step all-gathers them (all_gather_into_tensor) and
averages gradients with reduce_scatter_tensor, both on loom. Rank 0 prints the loss.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import loom  # noqa: F401  (registers the "loom" backend)
from report import write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--backend", default="loom")
    parser.add_argument("--report", help="write losses and a weights digest here (for the tests)")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    teacher = nn.Linear(32, 8)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1000 + rank)
    first = last = None
    losses = []
    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=data)
        with torch.no_grad():
            y = teacher(x)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        report = loss.detach().clone()
        dist.all_reduce(report, op=dist.ReduceOp.AVG)
        first = report.item() if first is None else first
        last = report.item()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {last:.5f}", flush=True)
    if rank == 0:
        print(f"FSDP2 on {world} ranks: loss {first:.4f} -> {last:.4f}", flush=True)
    write_report(args.report, rank, losses, [p.full_tensor() for p in model.parameters()])
    dist.destroy_process_group()
    if last >= first:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
