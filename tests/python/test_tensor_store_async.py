"""loom.tensor_store's async forms (AsyncTensorStore): every verb awaited, a get waiting for
a version holding up no other verb (threads and coroutines, more than asyncio's executor
has threads), and cancellation: a cancelled get stops before it fills the caller's tensors,
whether it waited, was blocked where it does not look, or was cancelled twice during its
copies."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from store_samples import on_wait


def _async(rank, world):
    from loom.tensor_store import AsyncTensorStore

    async def main():
        ts = AsyncTensorStore()
        if rank == 0:
            await ts.put("a", torch.arange(5))
            await ts.put_state_dict({"w": torch.ones(3)}, "sd")
        await asyncio.to_thread(dist.barrier)
        got = await ts.get("a")
        sd = await ts.get_state_dict("sd")
        out = got.tolist(), sd["w"].tolist(), await ts.exists("a"), await ts.keys()
        await asyncio.to_thread(dist.barrier)  # the writer's buffers live as long as its store
        return out

    return asyncio.run(main())


def test_async_forms():
    for got, w, exists, keys in run_ranks(2, _async):
        assert got == [0, 1, 2, 3, 4] and w == [1.0, 1.0, 1.0] and exists and keys == ["a", "sd"]


def _waiting_get(rank, world):
    from loom.tensor_store import AsyncTensorStore, TensorStore

    # A thread waits for version 1 of "w"; once it does, another thread of the process puts
    # it. The put must not wait for the get (which would then time out, never put).
    ts = TensorStore()
    waiting = threading.Event()
    on_wait(ts, waiting.set)
    got = {}

    def reader():
        try:
            got["w"] = ts.get("w", version=1, timeout=timedelta(seconds=20)).tolist()
        except Exception as error:  # noqa: BLE001  (the test reports it)
            got["w"] = repr(error)

    thread = threading.Thread(target=reader)
    thread.start()
    waiting.wait()
    out = {"thread": ts.put("w", torch.full((3,), 7.0))}
    thread.join()
    out["thread"] = (out["thread"], got["w"])

    async def main():
        # The same between two coroutines of one AsyncTensorStore (verbs on worker threads).
        store = AsyncTensorStore()
        asked = threading.Event()
        on_wait(store.sync, asked.set)

        async def writer():
            await asyncio.to_thread(asked.wait)
            return await store.put("a", torch.arange(4))

        value, version = await asyncio.gather(store.get("a", version=1, timeout=timedelta(seconds=20)), writer())
        return version, value.tolist()

    async def many():
        # More waiting gets than asyncio's default executor has threads (at most 32): the
        # puts they wait for are not queued behind them.
        store = AsyncTensorStore()
        waiting = 40
        asked = threading.Semaphore(0)
        on_wait(store.sync, asked.release)
        gets = [store.get(f"k{i}", version=1, timeout=timedelta(seconds=20)) for i in range(waiting)]

        async def writer():
            for _ in range(waiting):
                await asyncio.to_thread(asked.acquire)
            return [await store.put(f"k{i}", torch.full((2,), float(i))) for i in range(waiting)]

        *values, versions = await asyncio.gather(*gets, writer())
        return versions == [1] * waiting and [v[0].item() for v in values] == list(range(waiting))

    out["async"] = asyncio.run(main())
    out["many"] = asyncio.run(many())
    return out


def test_a_get_waiting_for_a_version_holds_up_no_other_verb():
    assert run_ranks(1, _waiting_get, backend="gloo") == [
        {"thread": (1, [7.0] * 3), "async": (1, [0, 1, 2, 3]), "many": True}]


def test_a_cancelled_async_get_stops_before_it_fills_the_callers_tensors():
    # Its thread used to wait on and fill the tensors once the version came, after the caller
    # had read another version into them (two threads could fill them at once, each check
    # passing, leaving a mix of two versions).
    from loom.tensor_store import AsyncTensorStore, TensorStore, _read_plan, _store

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    writer = TensorStore(store, serve_remote=False)
    reader = AsyncTensorStore(store, serve_remote=False)
    mine = {"w": torch.zeros(1000)}

    def verb_threads():
        return [t for t in threading.enumerate() if t.name.startswith("loom-tensor-store-get")]

    def ended():  # the verbs' threads stop at their next wait (the version is minutes away)
        for thread in verb_threads():
            thread.join(30)
        return verb_threads() == []

    async def cancelled_waits():
        writer.put_state_dict({"w": torch.full((1000,), 1.0)}, "p")
        with pytest.raises((asyncio.TimeoutError, TimeoutError)):
            await asyncio.wait_for(reader.get_state_dict("p", mine, version=2, timeout=timedelta(seconds=60)), 0.2)
        assert ended()  # stopped at its wait, not at the version or the timeout
        await reader.get_state_dict("p", mine, version=1)
        task = asyncio.ensure_future(reader.get("p", version=3, timeout=timedelta(seconds=60)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ended()
        writer.put_state_dict({"w": torch.full((1000,), 2.0)}, "p")
        writer.put_state_dict({"w": torch.full((1000,), 3.0)}, "p")
        return mine["w"].unique().tolist()

    async def cancelled_while_blocked_elsewhere():
        # Blocked where it does not look (a fetch from a vanished host, say): the cancel ends
        # at once, the thread later stops before its copies.
        release = threading.Event()
        lookup = _store.TensorStore._parts

        def blocked(self, *args, **kwargs):
            release.wait(30)
            return lookup(self, *args, **kwargs)

        _store.TensorStore._parts = blocked
        try:
            task = asyncio.ensure_future(reader.get_state_dict("p", mine))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            waiting = [t.is_alive() for t in verb_threads()]
        finally:
            release.set()
            _store.TensorStore._parts = lookup
        for thread in verb_threads():
            thread.join(10)
        return waiting, mine["w"].unique().tolist()

    async def cancelled_twice_while_copying():
        # Cancelled twice during its copies: it ends only once they are done, never later.
        copying = threading.Event()
        copies = _read_plan.run_copies

        def slow(groups):
            copying.set()
            time.sleep(0.4)
            copies(groups)

        _read_plan.run_copies = slow
        try:
            task = asyncio.ensure_future(reader.get_state_dict("p", mine))
            await asyncio.to_thread(copying.wait, 10)
            task.cancel()
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            at_the_end = mine["w"].unique().tolist()
        finally:
            _read_plan.run_copies = copies
        await asyncio.sleep(0.5)
        return at_the_end, mine["w"].unique().tolist()

    try:
        assert asyncio.run(cancelled_waits()) == [1.0]
        assert asyncio.run(cancelled_while_blocked_elsewhere()) == ([True], [1.0])
        assert asyncio.run(cancelled_twice_while_copying()) == ([3.0], [3.0])
    finally:
        writer.close()
        reader.close()


def test_a_cancelled_make_lendable_ends_once_the_move_is_over_and_moves_nothing_after():
    # It used to end at the cancel while its thread went on moving the caller's tensors
    # (their .data swapped behind the caller's back, 1.5 s later in a review's reproduction).
    from loom.tensor_store import AsyncTensorStore, _lending

    store = AsyncTensorStore(dist.HashStore(), serve_remote=False)
    model = torch.nn.Linear(64, 64)
    before = {name: t.data_ptr() for name, t in model.state_dict().items()}
    moving = threading.Event()
    go_on = threading.Event()  # set only after the cancel, however late the loop comes back
    move = _lending.move_into

    def slow(buffer, tensors):
        moving.set()
        go_on.wait(10)
        move(buffer, tensors)

    async def cancelled_while_moving():
        task = asyncio.ensure_future(store.make_lendable(model))
        await asyncio.to_thread(moving.wait, 10)
        threading.Timer(0.3, go_on.set).start()  # the cancel below waits for the move to end
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        at_the_end = {name: t.data_ptr() != before[name] for name, t in model.state_dict().items()}
        await asyncio.sleep(0.6)
        later = {name: t.data_ptr() != before[name] for name, t in model.state_dict().items()}
        return at_the_end, later

    _lending.move_into = slow
    try:
        at_the_end, later = asyncio.run(cancelled_while_moving())
    finally:
        _lending.move_into = move
        store.close()
    assert at_the_end == later == {"weight": True, "bias": True}
