"""The ordering parts of check_cuda.py. dist.barrier() on a group with GPU work returns only
once every rank's earlier GPU work of the group has run, as NCCL's does (its barrier is an
all_reduce on the GPU whose stream the host then waits for); inside a CUDA graph capture it
stays a barrier of the hosts and leaves the capture intact. Run through check_cuda.py (its
worker dispatches here; `barrier_settles` and `barrier_of_a_cpu_group` run on a bound
group, `barrier_settles_unbound` on one without init_process_group's device_id). A group that
has run no CUDA call waits for no stream. And a receive held by a coalescing block
(`held_copy_back`): its own work's wait() orders the caller's stream after the copy of a
staged receive back into the caller's tensor, not only after the transfer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from check_common import same

# About 0.3 s of GPU time on an H100 or H200 (torch.cuda._sleep spins for clock cycles).
SLEEP_CYCLES = 600_000_000


def barrier_settles(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """Rank 0's GPU is kept busy before an asynchronous all_reduce and a blocking one that
    nobody waits for on the host; after dist.barrier() every rank finds both done on its
    GPU (the all_reduce needs rank 0's data, so no rank's can end before rank 0's GPU got to
    it), with the right sums."""
    x = torch.full((1 << 20,), float(rank + 1), device=dev)
    y = torch.full((4096,), float(rank + 1), device=dev)
    dist.barrier()
    torch.cuda.synchronize()
    if rank == 0:
        torch.cuda._sleep(SLEEP_CYCLES)
    work = dist.all_reduce(x, async_op=True)
    dist.all_reduce(y)  # on the caller's stream, not waited for by the host
    dist.barrier()
    assert work.is_completed(), "the barrier returned before this rank's all_reduce ran on the GPU"
    assert torch.cuda.current_stream().query(), "the barrier returned with the caller's stream busy"
    total = world * (world + 1) / 2
    work.wait()
    same(x, torch.full((1 << 20,), total), "the asynchronous all_reduce")
    same(y, torch.full((4096,), total), "the blocking all_reduce")
    return 3


def barrier_of_a_cpu_group(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """A loom group that has run no CUDA call, in a job bound to the GPU (torch binds its new
    groups too), waits for no stream: its barrier returns while the caller's stream still
    sleeps (1 s of GPU time against a host barrier of milliseconds), as Gloo's does."""
    cpu_group = dist.new_group(backend="loom")
    t = torch.ones(4)
    dist.all_reduce(t, group=cpu_group)
    torch.cuda.synchronize()
    torch.cuda._sleep(4 * SLEEP_CYCLES)
    dist.barrier(group=cpu_group)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "the barrier of a group without GPU work waited for the caller's stream"
    assert t.tolist() == [float(world)] * 4
    return 1


def barrier_in_capture(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """A barrier issued while the caller's stream is captured meets the other ranks' on the
    host and leaves the capture whole: the replayed all_reduce sums as it should."""
    x = torch.full((1024,), float(rank + 1), device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        dist.all_reduce(x)  # warm up outside the capture, as torch's graph docs ask
        torch.cuda.synchronize()
        x.fill_(float(rank + 1))
        with torch.cuda.graph(graph, stream=side):
            dist.all_reduce(x)
            dist.barrier()
    torch.cuda.current_stream().wait_stream(side)
    x.fill_(float(rank + 1))
    graph.replay()
    torch.cuda.synchronize()
    same(x, torch.full((1024,), world * (world + 1) / 2), "the replayed all_reduce")
    return 1


def held_copy_back(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """Ranks 0 and 1 swap 256 MiB in a coalescing block, each receiving into a transposed
    view (staged: copied back after the transfer, a slow transposing copy). Right after the
    receive's own work's wait(), a kernel on the caller's stream reads the tensor: it must
    see every element. (The work ended with the transfer, and nothing ordered the caller's
    stream after the copy-back.)"""
    if rank >= 2:
        return 0
    peer = 1 - rank
    n = 8192
    grid = torch.zeros(n, n, device=dev)
    mine = torch.full((n, n), float(rank + 1), device=dev)  # what the peer receives
    torch.cuda.synchronize()
    with dist._coalescing_manager(device=dev, async_ops=True):
        received = dist.irecv(grid.t(), src=peer)
        dist.isend(mine, dst=peer)
    received.wait()
    total = grid.sum()  # on the caller's stream, right after the wait
    torch.cuda.synchronize()
    assert total.item() == float(peer + 1) * n * n, (total.item(), float(peer + 1) * n * n)
    return 1
