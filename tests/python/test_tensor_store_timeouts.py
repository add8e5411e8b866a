"""Tensor store reads against writers that are slow: a get ends at its timeout, whatever
the writer does meanwhile, and sooner, told why, once a writer it waits for has exited."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from store_samples import sync


def _slow_writer(rank, world):
    from loom.tensor_store import TensorStore, _parts

    store = dist.distributed_c10d._get_default_store()
    # 4 KiB buckets, four of them: the reader copies bucket by bucket as they are written.
    ts = TensorStore(bucket_bytes=4096, timeout=timedelta(seconds=60))
    weights = {name: torch.full((1024,), 1.0) for name in "abcd"}
    if rank == 0:
        ts.put_state_dict(weights, "w")
        sync(store, "reading")
        copies = _parts.run_copies

        def slowly(groups, *args):  # a writer that takes a second over each bucket
            time.sleep(1.0)
            copies(groups, *args)

        _parts.run_copies = slowly
        ts.put_state_dict(weights, "w")
        _parts.run_copies = copies
        sync(store, "read")
        return None
    mine = {name: torch.zeros(1024) for name in "abcd"}
    ts.get_state_dict("w", mine, version=1)
    store.set("reading", "1")
    start = time.monotonic()
    try:
        ts.get_state_dict("w", mine, version=2, timeout=timedelta(seconds=2.5))
        outcome = "read"
    except TimeoutError as e:
        outcome = str(e)
    took = time.monotonic() - start
    store.set("read", "1")
    return outcome, took


def test_a_get_from_a_slow_writer_ends_at_its_timeout():
    """Each bucket's wait for the writer's bytes used to begin a timeout of its own: the get
    read all four buckets, a second apart, about 4 s into its 2.5 s timeout."""
    _, (outcome, took) = run_ranks(2, _slow_writer)
    assert "did not finish writing it within 0:00:02.500000" in outcome, outcome
    assert took < 3.5, took


def _mesh_writer_gone(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from loom.tensor_store import TensorStore, TensorStoreError

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore()
    pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "shard"))["shard"]
    if rank < 2:  # ranks 0 and 1 each put their shard of version 1
        ts.put("w", distribute_tensor(torch.ones(4, 4), pairs, [Shard(0)]))
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # the second writer of the mesh crashes
    if rank != 2:
        sync(store, "told")
        return "waited"
    # Version 2 needs rank 1's part too: told so, naming it, not after the timeout (only the
    # first part's writer was looked at).
    with pytest.raises(TensorStoreError, match=r"version=2\): rank 1 \(pid \d+\), which wrote version 1, "
                                               r"has exited"):
        ts.get("w", version=2, timeout=timedelta(seconds=120))
    store.set("told", "1")
    return "told"


def test_a_get_waiting_for_a_version_from_a_mesh_whose_second_writer_exited_is_told():
    assert run_ranks(4, _mesh_writer_gone, killed=(1,), finalize=False) == ["waited", "killed", "told",
                                                                             "waited"]
