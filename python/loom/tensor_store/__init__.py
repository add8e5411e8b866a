"""loom's tensor store: put/get of tensors, objects and whole state dicts between the
processes of a job, bytes moving straight from the writer's memory to the reader's.

    from loom.tensor_store import TensorStore
    ts = TensorStore()                         # over the default process group's Store
    ts.put_state_dict(model.state_dict(), "policy")          # trainer: a new version
    ts.get_state_dict("policy", generator.state_dict())      # generator: the latest, in place

Every verb has an async form on AsyncTensorStore (``await ts.put(...)``), as torchstore's.
docs/STORE.md says how it works, what it guarantees and what it costs.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from typing import Any

from ._cancellation import Token, run_cancellable
from ._store import TensorStore, TensorStoreError

__all__ = ["TensorStore", "AsyncTensorStore", "TensorStoreError"]


class AsyncTensorStore:
    """TensorStore's verbs as coroutines: each runs on a thread of its own (the copies release
    the GIL), so an event loop keeps serving while bytes move, and a get waiting for a version
    holds up no other coroutine's verb, however many wait. Takes TensorStore's arguments."""

    _VERBS = ("put", "get", "put_state_dict", "get_state_dict", "put_batch", "get_batch", "delete",
              "exists", "keys", "latest_version", "make_lendable", "lend", "lend_state_dict", "reclaim",
              "broadcast_state_dict")

    def __init__(self, *args: Any, **kwargs: Any):
        self.sync = TensorStore(*args, **kwargs)

    def __getattr__(self, name: str):
        if name not in self._VERBS:
            raise AttributeError(name)
        verb = getattr(self.sync, name)

        @functools.wraps(verb)
        async def call(*args: Any, **kwargs: Any):
            return await _on_own_thread(name, verb, *args, **kwargs)

        return call

    def close(self) -> None:
        """Frees this process's buffers (see TensorStore.close)."""
        self.sync.close()


# Verbs every member of a group takes part in: a cancel waits for them to end.
_COLLECTIVE_VERBS = frozenset({"broadcast_state_dict"})


async def _on_own_thread(name: str, verb, *args: Any, **kwargs: Any):
    """verb(*args, **kwargs) on a new thread, awaited. Not the loop's executor (what
    asyncio.to_thread uses): its few threads, all taken by gets waiting for a version, would
    queue the very put they wait for behind them. Cancelled, it stops the verb (at its next
    wait, or before it touches the caller's tensors) and ends once the verb no longer
    touches them (a copy under way finishes first): a get cancelled by a timeout never fills
    them later, beside the next get."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    token = Token()
    context = contextvars.copy_context()  # as asyncio.to_thread passes the caller's context

    def settle(result: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is None:
            done.set_result(result)
        else:
            done.set_exception(error)

    def run() -> None:
        try:
            outcome = (context.run(run_cancellable, token, verb, *args, **kwargs), None)
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting coroutine
            # Cancelled, nobody reads it: not kept, nor its traceback's frames (their reads'
            # mappings of writers' buffers would live on until the cycle collector ran).
            outcome = (None, None if token.event.is_set() else error)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed meanwhile: no one awaits the verb any more
            pass

    threading.Thread(target=run, name=f"loom-tensor-store-{name}").start()
    try:
        return await asyncio.shield(done)  # shielded: a cancel leaves `done` to the verb
    except asyncio.CancelledError:
        # Its outcome is nobody's: read, so asyncio logs no "exception was never retrieved".
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        # Off the loop's thread (a copy under way may take a while); cancelled again
        # meanwhile, it still waits: returning early would break the promise above. A
        # collective cannot stop (the group's other members wait in it): its whole run is
        # waited for.
        stopped = done if name in _COLLECTIVE_VERBS else loop.run_in_executor(None, token.cancel)
        while not stopped.done():
            try:
                await asyncio.shield(stopped)
            except asyncio.CancelledError:
                pass
        raise
