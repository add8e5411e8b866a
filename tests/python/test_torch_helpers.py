"""torch's own helpers that treat backends by name or by their devices, on loom groups as on
Gloo's: _set_pg_timeout (what dist.breakpoint() calls on every group) and ShardedTensor's
gather (which picks a device from the backend's registration)."""

from __future__ import annotations

import os
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from harness import run_ranks

import loom  # noqa: F401,E402  (registers the backend in this process, which the sharded test reads)


def body_pg_timeout(rank: int, world: int, backend: str):
    """A group made with a 2 s timeout, given 60 s by _set_pg_timeout, waits 4 s for a late
    rank. (On loom torch's helper warned that it sets Gloo's and NCCL's only, and the wait
    failed at 2 s: dist.breakpoint() could not hold the peers while one rank debugged.)"""
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c10d._set_pg_timeout(timedelta(seconds=60), group)
    if rank == 1:
        time.sleep(4)
    t = torch.ones(2)
    dist.all_reduce(t, group=group)
    return t.tolist(), [str(w.message) for w in caught if "timeout" in str(w.message).lower()]


def test_set_pg_timeout_sets_a_loom_groups_timeout():
    for backend in ("gloo", "loom"):
        assert run_ranks(2, body_pg_timeout, backend, timeout=90) == [([2.0, 2.0], [])] * 2, backend
    assert run_ranks(2, body_pg_timeout_wrapped, timeout=90) == [(timedelta(seconds=60), [])] * 2


def body_pg_timeout_wrapped(rank: int, world: int):
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch wraps each backend: loom's is found inside
    the wrapper and given the timeout (it was not: torch's warning, and loom's 2 s stayed).
    Not a late rank here: the wrapper's own checks run on a Gloo group of the old timeout,
    which torch's helper does not reach (for Gloo groups either)."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()  # torch read it at import, before the harness forked
    group = dist.new_group(timeout=timedelta(seconds=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c10d._set_pg_timeout(timedelta(seconds=60), group)
    loom_backend = group._get_backend(torch.device("cpu")).wrapped_pg
    return loom_backend.options._timeout, [str(w.message) for w in caught if "timeout" in str(w.message).lower()]


def body_sharded_gather(rank: int, world: int):
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    shards = sharded_tensor.ones(spec, 4, 3)
    out = torch.zeros(4, 3) if rank == 0 else None
    shards.gather(dst=0, out=out)
    return None if out is None else out.sum().item()


def test_a_sharded_tensor_gathers_on_a_torch_without_cuda():
    # torch gathers on a backend's first registered device that is not the CPU: loom
    # registers for CUDA only where torch has it ("Torch not compiled with CUDA enabled").
    if torch.backends.cuda.is_built():
        pytest.skip("this torch has CUDA: the gather takes a GPU")
    assert dist.Backend.backend_capability["loom"] == ["cpu"]
    assert run_ranks(2, body_sharded_gather) == [12.0, None]


def body_default_backend(rank: int, world: int):
    """Groups of several halves with no NCCL among them, made in a process that imported
    loom. (torch's check for a plugin among the halves never matched once one was registered,
    so such groups had no default backend: "undefined" as their name, sequence numbers
    refused, and a warning when destroyed.)"""
    gloo = dist.new_group(backend="cpu:gloo")
    both = dist.new_group(backend="cpu:loom,cuda:gloo")
    plain = dist.new_group(backend="loom")
    t = torch.ones(2)
    dist.all_reduce(t, group=gloo)
    dist.all_reduce(t, group=both)
    names = [g._get_backend_name() for g in (gloo, both, plain)]
    return names, gloo._get_sequence_number_for_group(), t.tolist()


def test_groups_of_several_halves_get_the_default_backend_torch_means():
    for names, sequence, t in run_ranks(2, body_default_backend):
        # The loom half makes a group named as a plain loom group is; Gloo's is Gloo's.
        assert names == ["gloo", "custom", "custom"], names
        assert sequence >= 1, sequence
        assert t == [4.0, 4.0], t
