"""The PREMUL_SUM part of check_cuda.py: a factor given as a CUDA tensor, read by the GPU
(its mismatch parts, factors that differ by rank, are in check_failures.py). Run through
check_cuda.py (its worker dispatches here)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from test_collectives import data

from check_common import LARGE, same


def scaled_sum(inputs, factor: float, dtype: torch.dtype) -> torch.Tensor:
    """PREMUL_SUM's reference with any factor, computed in float64."""
    return (torch.stack([t.double() for t in inputs]) * factor).sum(0).to(dtype)


def premul_factors(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """PREMUL_SUM with its factor given as a CUDA tensor, as NCCL takes it: the GPU reads the
    factor when the call runs, never the host. The results equal a factor given as a number
    (all_reduce, reduce, reduce_scatter_tensor; one step and several; a factor of the data's
    dtype or float32), a factor still being computed on the caller's stream when the call is
    issued is the one used, and a CUDA graph captures such calls (the host reading the factor
    would end the capture) and reads the factor anew at every replay."""
    checks = 0
    for dtype in [d for d in dtypes if d.is_floating_point]:
        for n in [1, 1000, 70_000] + ([LARGE] if dtype == torch.float32 else []):
            inputs = [data(r, n, dtype, n + 3) for r in range(world)]
            for factor_dtype in sorted({dtype, torch.float32}, key=str):
                what = f"{dtype} n={n} factor {factor_dtype}"
                op = dist._make_nccl_premul_sum(torch.tensor(0.25, dtype=factor_dtype, device=dev))
                t = inputs[rank].to(dev)
                dist.all_reduce(t, op=op)
                same(t, scaled_sum(inputs, 0.25, dtype), "all_reduce " + what)
                t = inputs[rank].to(dev)
                dist.reduce(t, dst=0, op=op)
                if rank == 0:
                    same(t, scaled_sum(inputs, 0.25, dtype), "reduce " + what)
                blocks = [data(r, n * world, dtype, n + 5) for r in range(world)]
                out = torch.empty(n, dtype=dtype, device=dev)
                dist.reduce_scatter_tensor(out, blocks[rank].to(dev), op=op)
                same(out, scaled_sum(blocks, 0.25, dtype)[rank * n:(rank + 1) * n],
                     "reduce_scatter_tensor " + what)
                checks += 3
    # The factor is written by a kernel queued after a long one: the call must use its value.
    inputs = [data(r, 4096, torch.float32, 11) for r in range(world)]
    factor = torch.zeros((), device=dev)
    t = inputs[rank].to(dev)
    torch.cuda._sleep(20_000_000)
    factor.fill_(0.75)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))
    same(t, scaled_sum(inputs, 0.75, torch.float32), "all_reduce with a factor in the making")
    checks += 1
    # Captured: each replay scales by the factor's value at that replay.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_reduce(torch.ones(8, device=dev))
    torch.cuda.current_stream().wait_stream(side)
    x = torch.zeros(70_000, device=dev)
    y = torch.zeros(70_000 * world, device=dev)
    y_out = torch.empty(70_000, device=dev)
    factor = torch.ones((), device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(x, op=dist._make_nccl_premul_sum(factor))
        dist.reduce_scatter_tensor(y_out, y, op=dist._make_nccl_premul_sum(factor))
    for replay, value in enumerate([0.5, 2.0, -1.5]):
        everyone = [data(r, 70_000, torch.float32, 20 + replay) for r in range(world)]
        blocks = [data(r, 70_000 * world, torch.float32, 30 + replay) for r in range(world)]
        x.copy_(everyone[rank])
        y.copy_(blocks[rank])
        factor.fill_(value)
        graph.replay()
        same(x, scaled_sum(everyone, value, torch.float32), f"replay {replay} all_reduce by {value}")
        same(y_out, scaled_sum(blocks, value, torch.float32)[rank * 70_000:(rank + 1) * 70_000],
             f"replay {replay} reduce_scatter_tensor by {value}")
        checks += 2
    return checks
