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
import functools
from typing import Any

from ._store import TensorStore, TensorStoreError

__all__ = ["TensorStore", "AsyncTensorStore", "TensorStoreError"]


class AsyncTensorStore:
    """TensorStore's verbs as coroutines: each runs on a worker thread (the copies release
    the GIL), so an event loop keeps serving while bytes move, and a get waiting for a version
    holds up no other coroutine's verb. Takes TensorStore's arguments."""

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
            return await asyncio.to_thread(verb, *args, **kwargs)

        return call

    def close(self) -> None:
        """Frees this process's buffers (see TensorStore.close)."""
        self.sync.close()
