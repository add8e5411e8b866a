"""Tensor store reads against writers that are slow: a get ends at its timeout, whatever
the writer does meanwhile."""

from __future__ import annotations

import time
from datetime import timedelta

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
