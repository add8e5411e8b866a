"""The timing part of check_cuda.py: Work.get_duration() on CUDA calls after the group's
_enable_collectives_timing(), timed by the GPU between events around what each call queued
(torch_plugin/call_timing.h). Run through check_cuda.py (its worker dispatches here).
A first version of this part did not finish on an H100 within 100 s: its ranks had died
of a crash in the refusals' message formatting (docs/perf/cuda_timing_h100.txt)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from test_work_timing import refusal

from check_common import same


def timing(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """An untimed call's work says how to time it; a timed call's work answers once the GPU
    has run it (rank 0's call, whose peer joins late, refuses before that, with the reason);
    a blocking call's own work, a coalesced block's of collectives and one of sends and
    receives are timed too (a held send's own work names the block's); results stay right."""
    checks = 0
    group = dist.group.WORLD
    x = torch.ones(1024, device=dev)
    untimed = dist.all_reduce(x, async_op=True)
    untimed.wait()
    message = refusal(untimed)
    assert "_enable_collectives_timing()" in message, message
    checks += 1
    group._enable_collectives_timing()
    dist.barrier()
    if rank == 1:
        time.sleep(0.5)
    y = torch.full((1 << 20,), float(rank + 1), device=dev)
    work = dist.all_reduce(y, async_op=True)
    if rank == 0:
        # Its GPU waits for rank 1's data; the host does not.
        early = refusal(work)
        assert "has not run the call yet" in early, early
        checks += 1
    work.wait()
    torch.cuda.current_stream().synchronize()
    duration = work._get_duration()
    assert duration > 0, duration
    same(y, torch.full((1 << 20,), world * (world + 1) / 2), "timed all_reduce")
    checks += 2
    options = dist.AllreduceOptions()
    options.asyncOp = False
    z = torch.ones(16, device=dev)
    blocking = group._get_backend(dev).allreduce([z], options)
    blocking.synchronize()
    assert blocking._get_duration() > 0
    same(z, torch.full((16,), float(world)), "blocking all_reduce")
    checks += 2
    with dist._coalescing_manager(async_ops=True) as manager:
        a = torch.ones(64, device=dev)
        dist.all_reduce(a)
        dist.all_reduce(torch.ones(64, device=dev))
    manager.wait()
    torch.cuda.synchronize()
    durations = [w._get_duration() for w in manager.works]
    assert durations and all(d > 0 for d in durations), durations
    same(a, torch.full((64,), float(world)), "coalesced all_reduce")
    checks += 2
    peer_to = (rank + 1) % world
    peer_from = (rank - 1) % world
    sent = torch.full((256,), float(rank), device=dev)
    got = torch.empty(256, device=dev)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, peer_to),
                                    dist.P2POp(dist.irecv, got, peer_from)])
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    assert works[-1]._get_duration() > 0
    same(got, torch.full((256,), float(peer_from)), "batch_isend_irecv")
    checks += 2
    # With its device named, the manager opens loom's block (without, torch issues each
    # send apart): a CUDA send there is held until the block ends.
    with dist._coalescing_manager(device=dev, async_ops=True) as manager:
        held = dist.isend(sent, peer_to)
        dist.irecv(got, peer_from)
    manager.wait()
    torch.cuda.synchronize()
    message = refusal(held)
    assert "runs with the whole block" in message, message
    assert manager.works[-1]._get_duration() > 0
    checks += 2
    return checks
