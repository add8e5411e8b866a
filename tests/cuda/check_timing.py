"""The timing part of check_cuda.py: after the group's _enable_collectives_timing(), a CUDA
call's Work.get_duration() says that loom does not time CUDA calls yet (torch_plugin/
call_timing.h), for an asynchronous call, a blocking call's own work and a coalesced one,
and the calls' results stay right. Run through check_cuda.py (its worker dispatches here).
A first version of this part, when loom timed CUDA calls with events, did not finish on an
H100 within 100 s (docs/perf/cuda_floor_h100.txt); that timing was taken out."""

from __future__ import annotations

import torch
import torch.distributed as dist

from test_work_timing import refusal

from check_common import same


def timing(rank: int, world: int, dev: torch.device, dtypes) -> int:
    checks = 0
    group = dist.group.WORLD
    group._enable_collectives_timing()
    y = torch.full((1 << 20,), float(rank + 1), device=dev)
    work = dist.all_reduce(y, async_op=True)
    work.wait()
    torch.cuda.synchronize()
    same(y, torch.full((1 << 20,), world * (world + 1) / 2), "all_reduce")
    options = dist.AllreduceOptions()
    options.asyncOp = False
    z = torch.ones(16, device=dev)
    blocking = group._get_backend(dev).allreduce([z], options)
    blocking.synchronize()
    same(z, torch.full((16,), float(world)), "blocking all_reduce")
    with dist._coalescing_manager(async_ops=True) as manager:
        a = torch.ones(64, device=dev)
        dist.all_reduce(a)
        dist.all_reduce(torch.ones(64, device=dev))
    manager.wait()
    torch.cuda.synchronize()
    same(a, torch.full((64,), float(world)), "coalesced all_reduce")
    for w in [work, blocking] + list(manager.works):
        message = refusal(w)
        assert "not yet calls on CUDA tensors" in message, message
        checks += 1
    return checks + 3
