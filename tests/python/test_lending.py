"""Backend tensor allocation (c10d's allocate_tensor): CPU tensors from loom's lending pool,
read in place by the peers in large all_gathers and reduce_scatters. Results equal the
staged path's, bit for bit, and FSDP2 with set_allocate_memory_from_process_group_for_comm
trains to the same parameters as without it; loom._C.lent_collectives proves the in-place
path ran."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import run_ranks

# Every size reads in place (the default starts at 1 MiB).
LEND_ALL = {"LOOM_LEND_BYTES": "0"}


def backend_of_world():
    return dist.group.WORLD._get_backend(torch.device("cpu"))


def collectives_on_lent_tensors(rank: int, world: int) -> dict:
    import loom

    backend = backend_of_world()
    assert backend.supports_tensor_alloc(torch.device("cpu"))
    before = loom._C.lent_collectives()
    results = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        n = 70_000  # per rank; 64 KiB and more come from the pool
        # all_gather in place, as FSDP2 does: the input is this rank's block of the output.
        out = backend.allocate_tensor(n * world, dtype=dtype, device=torch.device("cpu"))
        # Ranks learn that every process lends at a collective's opening: any one will do.
        dist.barrier()
        assert out.shape == (n * world,) and out.dtype == dtype and out.device.type == "cpu"
        mine = out.narrow(0, rank * n, n)
        for step in range(3):  # rewritten right after each call returns
            mine.copy_(torch.arange(n, dtype=torch.float64).mul(rank + 1 + step).to(dtype))
            dist.all_gather_into_tensor(out, mine)
            for q in range(world):
                want = torch.arange(n, dtype=torch.float64).mul(q + 1 + step).to(dtype)
                assert torch.equal(out.narrow(0, q * n, n), want), (dtype, step, q)
        # reduce_scatter from a lent input into an ordinary output, checked against the
        # same call on ordinary memory (the staged path): bit-identical.
        full = backend.allocate_tensor(n * world, dtype=dtype, device=torch.device("cpu"))
        g = torch.Generator().manual_seed(rank)
        full.copy_(torch.randint(-50, 50, (n * world,), generator=g).to(dtype))
        got = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(got, full, op=dist.ReduceOp.SUM)
        staged = torch.empty(n, dtype=dtype)
        plain = full.clone()
        dist.reduce_scatter_tensor(staged, plain, op=dist.ReduceOp.SUM)
        assert torch.equal(got, staged), dtype
        results[str(dtype)] = got.double().sum().item()
    # Small requests come from torch's allocator and still work.
    small = backend.allocate_tensor(10, dtype=torch.float32, device=torch.device("cpu"))
    small.fill_(rank)
    gathered = torch.empty(10 * world)
    dist.all_gather_into_tensor(gathered, small)
    assert torch.equal(gathered, torch.arange(world, dtype=torch.float32).repeat_interleave(10))
    results["lent"] = loom._C.lent_collectives() - before
    return results


def test_collectives_on_lent_tensors_match_staged():
    world = 3
    results = run_ranks(world, collectives_on_lent_tensors, env=LEND_ALL)
    for rank, r in enumerate(results):
        # 3 dtypes x (3 all_gathers + 1 reduce_scatter) read in place; the staged twins not.
        assert r["lent"] == 12, (rank, r["lent"])


def refused(rank: int, world: int) -> list[str]:
    backend = backend_of_world()
    assert not backend.supports_tensor_alloc(torch.device("cuda", 0))
    messages = []
    for size in (-1, 1 << 62):
        with pytest.raises(RuntimeError) as info:
            backend.allocate_tensor(size, dtype=torch.float32, device=torch.device("cpu"))
        messages.append(str(info.value))
    # A device without an index reads as supported (the backend sees only the index, -1 as
    # for CPU): what it gets there is a plain allocation, as FSDP2 would have made itself.
    assert backend.supports_tensor_alloc(torch.device("meta"))
    other = backend.allocate_tensor(10, dtype=torch.float16, device=torch.device("meta"))
    messages.append((other.device.type, other.dtype, tuple(other.shape)))
    return messages


def test_allocate_tensor_refuses_bad_requests_with_a_reason():
    for negative, huge, other in run_ranks(2, refused):
        assert "must be >= 0" in negative and "rank" in negative
        assert "more memory than any host has" in huge
        assert other == ("meta", torch.float16, (10,))


def fsdp2_steps(rank: int, world: int, from_group: bool) -> list[torch.Tensor]:
    import loom
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)), nn.Linear(256, 8))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in (*model, model):  # the setting is per fully_shard module
        if hasattr(module, "set_allocate_memory_from_process_group_for_comm"):
            module.set_allocate_memory_from_process_group_for_comm(from_group)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = loom._C.lent_collectives()
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(16, 256, generator=g), torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    lent = loom._C.lent_collectives() - before
    return [lent] + [p.full_tensor().detach().clone() for p in model.parameters()]


def test_fsdp2_from_the_group_trains_like_without():
    world = 2
    lent = run_ranks(world, fsdp2_steps, True, env=LEND_ALL)
    plain = run_ranks(world, fsdp2_steps, False, env=LEND_ALL)
    for rank in range(world):
        # Every all_gather and reduce_scatter of the steps read in place, and only with it on.
        assert lent[rank][0] > 0 and plain[rank][0] == 0, (lent[rank][0], plain[rank][0])
        for i, (a, b) in enumerate(zip(lent[rank][1:], plain[rank][1:])):
            assert torch.equal(a, b), f"rank {rank}, parameter {i}"
