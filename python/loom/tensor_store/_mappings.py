"""The writer buffers a reader keeps open: mapped on this host, fetched through a
RemoteBuffer from another. Per (key, part, buffer) slot it keeps up to `keep` of them (a
writer rotates that many buffers per key, and mapping one again faults in all its pages),
and only for the SLOTS slots read last: keys read once and then deleted by another rank (a
step's key) would otherwise keep their pages mapped for good."""

from __future__ import annotations

import collections
from typing import Callable

from ._parts import MappedBuffer, PartMeta
from ._read_plan import Released, TensorStoreError
from ._remote import OtherJob, RemoteBuffer

SLOTS = 64


class ReaderMappings:
    """A TensorStore's open writer buffers (used under its lock)."""

    def __init__(self, keep: int, host: str, job_store, message: Callable[[str], str],
                 forget_plans: Callable[[str], None]):
        self._keep = keep
        self._host = host
        self._job_store = job_store  # the byte fetch's credentials
        self._message = message
        self._forget_plans = forget_plans  # a key's read plans hold buffers too
        self._open: dict[str, MappedBuffer | RemoteBuffer] = {}  # by region id
        # (key, part, buffer) -> region ids, newest first; least recently read slot first
        self._reading: collections.OrderedDict[tuple, collections.deque] = collections.OrderedDict()

    def buffer(self, part: PartMeta, which: int) -> MappedBuffer | RemoteBuffer:
        """Buffer `which` of `part`, opened now unless it is open already."""
        meta = part.buffers[which]
        slot = (part.key, part.index, which)
        opened = self._open.get(meta.region_id)
        if opened is None and part.host != self._host:
            if part.server is None:
                raise TensorStoreError(self._message(
                    f"'{part.key}' version {part.version} was put by rank {part.rank} on another host, "
                    f"and {part.unserved}"))
            try:
                opened = RemoteBuffer(meta, part.server, self._job_store, self._message)
            except OtherJob as error:
                raise TensorStoreError(self._message(
                    f"'{part.key}' version {part.version} was put by rank {part.rank} on another host, "
                    f"and {error}")) from error
            self._open[meta.region_id] = opened
        elif opened is None:
            try:
                opened = MappedBuffer(meta)
            except RuntimeError as error:
                raise Released(self._message(
                    f"'{part.key}' version {part.version}: cannot open the buffer of rank "
                    f"{part.rank} (pid {meta.pid}): {error}")) from error
            self._open[meta.region_id] = opened
        recent = self._reading.setdefault(slot, collections.deque())
        self._reading.move_to_end(slot)
        if meta.region_id in recent:
            recent.remove(meta.region_id)
        recent.appendleft(meta.region_id)
        while len(recent) > self._keep:
            self._open.pop(recent.pop(), None)
        # Beyond SLOTS, the least recently read slot of another key goes, with its key's read
        # plans: a later read opens it again.
        while len(self._reading) > SLOTS:
            oldest = next((s for s in self._reading if s[0] != part.key), None)
            if oldest is None:
                break
            self._drop(oldest)
        return opened

    def forget_key(self, key: str) -> None:
        """Closes every buffer of `key` (this rank deleted it)."""
        for slot in [slot for slot in self._reading if slot[0] == key]:
            self._drop(slot)

    def clear(self) -> None:
        self._open.clear()
        self._reading.clear()

    def _drop(self, slot: tuple) -> None:
        for region in self._reading.pop(slot, ()):
            self._open.pop(region, None)
        self._forget_plans(slot[0])
