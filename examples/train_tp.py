"""Tensor-parallel training on a DeviceMesh (DTensor), through the loom backend.

    torchrun --nproc-per-node 2 examples/train_tp.py [--steps 50]

The mesh has one dimension over every rank; the MLP's first layer is split by columns and its
second by rows (parallelize_module), so each forward and backward runs loom's all_reduce and
all_gather on the mesh's group. Every rank feeds the same batch; rank 0 prints the loss.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import loom  # noqa: F401  (registers the "loom" backend)
from report import write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--backend", default="loom")
    parser.add_argument("--report", help="write losses and a weights digest here (for the tests)")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    teacher = nn.Linear(32, 8)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 8))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1000)  # the same batch on every rank
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
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.5f}", flush=True)
    if rank == 0:
        print(f"tensor parallel on {world} ranks: loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    write_report(args.report, rank, losses, [p.full_tensor() for p in model.parameters()])
    dist.destroy_process_group()
    if losses[-1] >= losses[0]:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
