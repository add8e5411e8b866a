"""Training through loom ends where training through Gloo and where one process on the
whole batch end: DDP, and FSDP2 (fully_shard) whose gradients must be averaged, not
summed (Gloo's reduce_scatter silently sums: pytorch/pytorch#162338)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run_alone, run_ranks

STEPS = 5
BATCH_PER_RANK = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH_PER_RANK, 16, generator=g), torch.randn(BATCH_PER_RANK, 4, generator=g)


def whole_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's batch of `step`, concatenated: what one process sees in the reference."""
    xs, ys = zip(*(batch(step, r) for r in range(world)))
    return torch.cat(xs), torch.cat(ys)


def train(model: nn.Module, batches) -> None:
    """STEPS steps of SGD on the MSE loss; batches(step) gives that step's (inputs, targets)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = batches(step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def single_process(rank: int, _one: int, world: int) -> list[torch.Tensor]:
    """The reference: one process, the concatenation of every `world` ranks' batches. Run as
    a forked rank of its own (run_alone): autograd must not start its threads in the pytest
    process, or later forked ranks cannot run backward on CUDA builds of torch."""
    model = make_model()
    train(model, lambda step: whole_batch(step, world))
    return [p.detach().clone() for p in model.parameters()]


def train_ddp(rank: int, world: int, backend: str) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = None if backend == "loom" else dist.new_group(backend=backend)
    model = DDP(make_model(), process_group=group)
    train(model, lambda step: batch(step, rank))
    return [p.detach().clone() for p in model.parameters()]


def train_fsdp2(rank: int, world: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train(model, lambda step: batch(step, rank))
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def check_close(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what}, parameter {i}: {m}")


def test_ddp_matches_gloo_and_single_process():
    world = 3
    loom_params = run_ranks(world, train_ddp, "loom")
    gloo_params = run_ranks(world, train_ddp, "gloo")
    reference = run_alone(single_process, world)
    for rank in range(world):
        check_close(loom_params[rank], reference, f"DDP on loom, rank {rank} vs one process")
        check_close(loom_params[rank], gloo_params[rank], f"DDP on loom vs Gloo, rank {rank}")


def test_fsdp2_averages_gradients():
    world = 2
    params = run_ranks(world, train_fsdp2)
    reference = run_alone(single_process, world)
    for rank in range(world):
        check_close(params[rank], reference, f"FSDP2 on loom, rank {rank} vs one process")
