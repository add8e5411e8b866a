"""A 2-D DeviceMesh with DTensor tensor parallelism on loom, and a torch.compile'd function
using functional collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run_ranks


def make_mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def tp_body(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert mesh["tp"].get_group().size() == 2 and mesh["dp"].get_group().size() == 2
    assert dist.get_backend(mesh["tp"].get_group()) == "loom"
    model = parallelize_module(make_mlp(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    # Ranks of one dp replica feed the same input; replicas feed different ones.
    dp_rank = mesh["dp"].get_local_rank()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dp_rank))
    out = model(x)
    want = make_mlp()(x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    # Backward runs through the sharded weights and their collectives too.
    out.sum().backward()
    ref = make_mlp()
    ref(x).sum().backward()
    grad = model[0].weight.grad.full_tensor()
    torch.testing.assert_close(grad, ref[0].weight.grad, rtol=1e-5, atol=1e-6)
    # The dp dimension's group works on its own.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh["dp"].get_group())
    tp_rank = mesh["tp"].get_local_rank()
    assert t.item() == float(tp_rank + (tp_rank + 2)), t


def compiled_body(rank: int, world: int) -> None:
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD

    @torch.compile(fullgraph=True)
    def step(x: torch.Tensor) -> torch.Tensor:
        y = funcol.all_reduce(x * 2, "sum", group)
        z = funcol.all_gather_tensor(y + 1, 0, group)
        return funcol.reduce_scatter_tensor(z, "sum", 0, group)

    x = torch.arange(4, dtype=torch.float32) + rank
    got = step(x)
    y = sum((torch.arange(4, dtype=torch.float32) + r) * 2 for r in range(world))
    want = (y + 1) * world
    torch.testing.assert_close(got, want)


def test_two_dimensional_mesh_tensor_parallel():
    run_ranks(4, tp_body)


def test_torch_compile_with_functional_collectives():
    run_ranks(2, compiled_body, timeout=600)
