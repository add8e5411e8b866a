"""Reading the buffers of writers on other hosts: loom's byte fetch over its network
transport (libfabric; src/transport/net/byte_server.h). A writer serves its buffers from the
moment it makes them, when loom has the transport and this host a fabric interface; a reader
on another host copies the byte ranges a read needs into a local copy of the buffer, over one
connection per writer that proves the job's secret, and reads that copy like a mapped buffer.

The credentials (the traffic's id and the secret) are drawn once per job into its Store, like
a communicator's; each process's id among servers and readers is a Store counter.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from .. import _C
from ._cancellation import Cancelled, current_stop_flag, stop_if_cancelled
from ._parts import BufferMeta, cached_view
from ._read_plan import Released, TensorStoreError

if TYPE_CHECKING:
    from ._parts import OwnedBuffer, PartMeta

_CREDENTIALS = "loom_ts/net/credentials"
_IDS = "loom_ts/net/ids"

_lock = threading.Lock()
_identity: tuple[bytes, int] | None = None  # this process's (credentials, id)
_server = None  # this process's _C.ByteServer, once started
_unserved = ""  # why this process cannot serve, once it tried and failed


class OtherJob(RuntimeError):
    """This process already reads or serves the buffers of another job across hosts."""


def identity(store) -> tuple[bytes, int]:
    """This process's (credentials, id) in the job whose Store is `store` (the base Store).
    Raises OtherJob if the process already took an identity in another job."""
    global _identity
    with _lock:
        credentials = store.compare_set(_CREDENTIALS, b"", os.urandom(32))  # the first draw wins
        if _identity is None:
            _identity = (credentials, int(store.add(_IDS, 1)))
        elif _identity[0] != credentials:
            raise OtherJob("this process already reads or serves the buffers of another job across "
                           "hosts (a TensorStore on another Store), and one process does that for one "
                           "job only")
        return _identity


def serve(store, buffer: "OwnedBuffer") -> tuple[tuple[str, int] | None, str]:
    """Serves `buffer` to readers on other hosts (until it is freed); returns (server's
    address and id, "") or (None, why not)."""
    global _server, _unserved
    if not getattr(_C, "has_network", False):
        return None, "this loom was built without its network transport (libfabric)"
    try:
        credentials, me = identity(store)
    except OtherJob as error:
        # Readers on this host still read the buffer; those on others are told why not.
        return None, f"{error} (pass serve_remote=False where no reader is on another host)"
    if _server is None and not _unserved:
        try:
            _server = _C.ByteServer.start(credentials, me)
        except RuntimeError as error:
            _unserved = f"it cannot open loom's network transport: {error}"
    if _server is None:
        return None, _unserved
    if buffer.device.type == "cpu":
        _server.publish(buffer.region)
    else:
        _server.publish_device(buffer.region, buffer.data)
    weakref.finalize(buffer, _server.withdraw, buffer.region.id)
    return (_server.address, me), ""


class RemoteBuffer:
    """A reader's copy of a buffer of a writer on another host, fetched for each read: the
    same face as MappedBuffer (view, state, check), the bytes in this process's memory."""

    def __init__(self, meta: BufferMeta, server: tuple[str, int], store, message):
        self.region_id = meta.region_id
        self._message = message  # the TensorStore's: names this rank
        self.address, self.server = server
        self.credentials, self.me = identity(store)  # OtherJob: ReaderMappings names the part
        self.data = torch.empty(meta.capacity, dtype=torch.uint8)
        self._views: dict[tuple, torch.Tensor] = {}
        self._state = "pending"  # of the last fetch
        self._unchanged = False
        # Held by a read from its fetch to its check (ReadPlan.run): the store's reads run on
        # several threads, and a fetch for one would rewrite the bytes another is copying.
        self.lock = threading.Lock()

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return cached_view(self._views, self.data, offset, dtype, shape)

    def prepare(self, generation: int, ranges: list[tuple[int, int]], part: "PartMeta", wait: timedelta,
                deadline: float | None = None) -> None:
        """Fetches `ranges` of generation `generation`, waiting while the writer has not
        finished writing it (until `deadline`, a monotonic time, or for `wait`). Raises
        TensorStoreError if the writer is gone or unreachable, TimeoutError after that."""
        if not ranges:  # nothing to copy (empty tensors alone): nothing can be torn either
            self._state, self._unchanged = "whole", True
            return
        if deadline is None:
            deadline = time.monotonic() + wait.total_seconds()
        pause = 1e-3
        what = f"'{part.key}' version {part.version}: rank {part.rank} at {self.address}"
        stop = current_stop_flag()  # a cancelled async get stops its fetch, and this buffer's lock
        while True:
            stop_if_cancelled()
            left = max(deadline - time.monotonic(), 0.0)
            state, now, _, unchanged, why = _C.fetch_bytes(
                self.credentials, self.me, self.address, self.server, self.region_id, generation,
                ranges, self.data, left, stop)
            if state == "stopped":
                raise Cancelled()
            if state == "timeout":
                raise TimeoutError(self._message(f"{what} did not answer within {wait}: {why}"))
            if state == "failed":
                raise TensorStoreError(self._message(f"{what} cannot be read (did it exit?): {why}"))
            if state == "unknown":
                # Withdrawn: a put of the writer retired the version and freed its buffer, or
                # the writer closed its store. The read says which (Released: a newer version
                # is read instead; with none, this is the error).
                released = Released(self._message(
                    f"{what} no longer serves that buffer: a newer put retired the version, or "
                    f"the writer closed its TensorStore"))
                released.while_copying = False  # fetched before any copy into the tensors
                raise released
            if state in ("whole", "replaced"):
                self._state = state
                self._unchanged = unchanged
                return
            if time.monotonic() > deadline:
                raise TimeoutError(self._message(f"{what} did not finish writing it within {wait}"))
            time.sleep(pause)  # writing or pending: the writer is on its way
            pause = min(2 * pause, 20e-3)

    def state(self, generation: int) -> str:
        return self._state

    def check(self, generation: int, written: int | None = None) -> bool:
        return self._state == "whole" and self._unchanged
