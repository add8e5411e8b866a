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
import time
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
    killed: tuple[int, ...] = (),
) -> list[Any]:
    """Runs fn(rank, world_size, *args) on `world_size` forked ranks; returns their results
    in rank order, or fails the calling test with every failing rank's traceback. With
    `finalize` the ranks meet in a closing barrier (skip it for tests that break the group).
    Ranks in `killed` are expected to die of SIGKILL (fault injection): their result is
    "killed", and dying any other way, or not dying, fails the test."""
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
        deadline = time.monotonic() + timeout
        unfinished = "did not finish within {timeout} s (killed)"
        try:
            while len(results) + len(errors) < world_size:
                try:
                    rank, status, payload = queue.get(timeout=0.2)
                except queue_module.Empty:
                    if time.monotonic() > deadline:
                        break
                    # A rank that died without reporting (a crash, a signal) fails the test
                    # at once, and its peers, who may wait for it forever, are killed. Its
                    # report may still be in the pipe: give it a moment first.
                    for r in killed:
                        if procs[r].exitcode == -9 and r not in results:
                            results[r] = "killed"
                    dead = [r for r, p in enumerate(procs) if p.exitcode is not None
                            and r not in results and r not in errors]
                    if dead:
                        time.sleep(0.5)
                        if queue.empty():
                            for r in dead:
                                errors[r] = f"rank {r} died without reporting (exit code {procs[r].exitcode})"
                            unfinished = "was killed after a peer died"
                            break
                    continue
                if status == "ok" and rank in killed:
                    errors[rank] = f"rank {rank} was to be killed but finished"
                elif status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
            for r in range(world_size):
                if r not in results and r not in errors:
                    errors[r] = f"rank {r} " + unfinished.format(timeout=timeout)
        finally:
            for p in procs:
                p.join(timeout=0 if errors else 5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            report = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
            pytest.fail(f"{len(errors)} rank(s) failed:\n{report}", pytrace=False)
        return [results[r] for r in range(world_size)]


def loom_names_in_dev_shm() -> list[str]:
    """Names in /dev/shm that loom could have written (any containing "loom"). loom names
    nothing there (its segments are memfds), so a leak check compares this before and after;
    the rest of /dev/shm belongs to whatever else runs on the machine."""
    return sorted(n for n in os.listdir("/dev/shm") if "loom" in n.lower())


def run_alone(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs fn(0, 1, *args) in one forked process (with a one-rank Gloo group) and returns
    its result: for reference computations that must not run in the pytest process."""
    return run_ranks(1, fn, *args, backend="gloo")[0]


def namespace_hosts(count: int, subnet: str):
    """`count` hosts made of network namespaces (loom._netns) for a test, removed afterwards;
    skips without root or iproute2, fails instead under LOOM_REQUIRE_NETNS=1."""
    from loom import _netns

    reason = _netns.unavailable_reason()
    if reason:
        if os.environ.get("LOOM_REQUIRE_NETNS") == "1":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return _netns.NamespaceHosts(count, subnet=subnet)
