"""Runs a test body on several forked ranks with torch.distributed initialised.

Each rank gets the default group on `backend` and (optionally) a Gloo group over the same
ranks, so a test can run the same call on both and compare. A rank that raises fails the
test with its traceback; ranks still running at the deadline are killed, so a hang is a
failure rather than a stuck CI job.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable

import pytest

_CTX = mp.get_context("fork")


def _rank_main(rank: int, world_size: int, init_file: str, backend: str, env: dict, finalize: bool,
               fn, args, queue):
    try:
        os.environ.update(env)
        import torch
        import torch.distributed as dist

        import loom  # noqa: F401  (registers the backend)

        torch.set_num_threads(1)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        result = fn(rank, world_size, *args)
        if finalize:
            dist.barrier()
        dist.destroy_process_group()
        # Pickled by value here: the queue's own pickler would share tensor memory with a
        # process that is about to exit.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001  (report everything, including SystemExit)
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    backend: str = "loom",
    env: dict | None = None,
    timeout: float = 300.0,
    finalize: bool = True,
) -> list[Any]:
    """Runs fn(rank, world_size, *args) on `world_size` forked ranks; returns their results
    in rank order, or fails the calling test with every failing rank's traceback. With
    `finalize` the ranks meet in a closing barrier (skip it for tests that break the group)."""
    queue = _CTX.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            _CTX.Process(
                target=_rank_main,
                args=(r, world_size, init_file, backend, env or {}, finalize, fn, args, queue),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            for _ in range(world_size):
                rank, status, payload = queue.get(timeout=timeout)
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
        except queue_module.Empty:
            for r in range(world_size):
                if r not in results and r not in errors:
                    errors[r] = f"rank {r} did not finish within {timeout} s (killed)"
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            report = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
            pytest.fail(f"{len(errors)} rank(s) failed:\n{report}", pytrace=False)
        return [results[r] for r in range(world_size)]
