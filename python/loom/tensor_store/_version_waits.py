"""The reader's waits for a version not out yet: for a lent key's next lend, and for the
Store entries of a version being put, each ended early, named, once it cannot be met (a
writer that exited, a version the writers skipped). TensorStore inherits it."""

from __future__ import annotations

import time
from datetime import timedelta

from ._cancellation import stop_if_cancelled
from ._parts import PartMeta
from ._read_plan import TensorStoreError
from ._verbs import asked


# What a mesh rank whose part of a version failed adds to the version's done count: no sum of
# parts' counts reaches it, and a count at or past it says the version will never be complete.
ABANDONED = 1 << 40



class VersionWaits:
    """The waits TensorStore's reads make; it supplies _store, _host, _lock, _mappings,
    _timeout, _latest, _get_now, _decode and _message."""

    def _await_lent(self, key: str, version: int, latest: int | None, timeout: timedelta | None,
                    writer: PartMeta | None = None) -> None:
        """Waits until the lent key `key` reaches `version` (or is gone); `writer`: the part
        lent now, if any."""
        wait = timeout if timeout is not None else self._timeout
        self._await_latest(key, version - 1, time.monotonic() + wait.total_seconds(),
                           f"{asked(key, version)}: not lent within {wait} (latest: {latest})", writer)

    def _await_latest(self, key: str, beyond: int, deadline: float, late: str, writer: PartMeta | None = None) -> None:
        """Waits until the latest version of `key` is past `beyond` or the key is gone (lent
        keys announce versions in `latest` alone), raising TimeoutError(`late`) at the
        deadline and TensorStoreError if `writer`'s process exits first."""
        local = writer is not None and writer.buffers and writer.host == self._host
        owner = writer.buffers[0] if local else None  # a writer elsewhere is watched by its server's connection
        pid = owner.pid if owner is not None else None
        # A writer of this host lends its next version into the buffer it lends now: its
        # generation moves past the next odd one (the reclaim) only when that lend is made,
        # so a shared-memory read says when to ask the Store again (no Store traffic while
        # the writer trains). Other buffers next time are caught by asking anyway, at most
        # `pause` apart.
        watched = None
        if local and writer.lent:
            try:
                with self._lock:  # the mappings are shared; the wait below is not under the lock
                    watched = (self._mappings.buffer(writer, 0), writer.generations[0])
            except TensorStoreError:  # its writer is gone: the loop below says so
                pass
        pause = 50e-6
        while True:
            stop_if_cancelled()
            latest = self._latest(key)
            if latest is None or latest[0] > beyond:
                return  # a newer version, or the key deleted: the next try says which
            if owner is not None and not owner.owner_alive():
                raise TensorStoreError(self._message(
                    f"{asked(key)}: rank {writer.rank} (pid {pid}) reclaimed version {writer.version} "
                    f"to change its tensors and exited before lending the next"))
            if time.monotonic() > deadline:
                raise TimeoutError(self._message(late))
            if watched is None:
                time.sleep(pause)
            else:
                until = time.monotonic() + pause
                while watched[0].region.generation() < watched[1] + 2 and time.monotonic() < until:
                    time.sleep(20e-6)
            pause = min(2 * pause, 1e-3)

    _LOOK_EVERY = 0.25  # seconds between looks at what the writers did meanwhile

    def _wait(self, key: str, version: int, names: list[str], wait: timedelta, deadline: float) -> None:
        """Waits until `deadline` (the get's `wait` from its start) for `names` (entries of
        `version` of `key`). Asked again and
        again rather than with the Store's blocking wait, which cannot be interrupted and
        whose timeouts TCPStore logs: a version past this one completed meanwhile (the writers
        skipped it), or a writer on this host that exited, ends the wait at once, named,
        instead of at the timeout. The pause grows to 5 ms, so a long wait costs the Store
        about 200 checks a second."""
        look = time.monotonic() + self._LOOK_EVERY
        pause = 50e-6
        while not self._store.check(names):
            stop_if_cancelled()
            now = time.monotonic()
            if now >= look or now >= deadline:
                look = now + self._LOOK_EVERY
                newest = self._latest(key)
                if newest is not None and newest[0] == version:
                    return  # complete just now: the caller reads it
                if newest is not None and newest[0] > version:
                    raise TensorStoreError(self._message(
                        f"{asked(key, version)}: the writers went on to version "
                        f"{newest[0]} without completing this one (they skipped it, or gave it up)"))
                done = self._get_now(f"k/{key}/v{version}/done")
                if done is not None and int(done) >= ABANDONED:
                    raise TensorStoreError(self._message(
                        f"{asked(key, version)}: a rank of the mesh that put it failed its "
                        f"part (its put raised), so it will never be complete; read the latest instead"))
                self._check_writer_alive(key, version, newest)
                if now >= deadline:
                    raise TimeoutError(self._message(
                        f"{asked(key, version)}: not put within {wait} (latest: "
                        f"{newest[0] if newest else None})"))
            time.sleep(pause)
            pause = min(2 * pause, 5e-3)

    def _check_writer_alive(self, key: str, version: int, latest) -> None:
        """Raises TensorStoreError if a process that wrote a part of `key`'s latest version
        (each rank of a DTensor's mesh writes one) runs on this host and has exited: the next
        version needs every part, and it will put no other."""
        if latest is None or latest[2] is not None:  # nothing out yet, or lent (watched apart)
            return
        for part in range(latest[1]):
            value = self._get_now(f"k/{key}/v{latest[0]}/p{part}")
            if value is None:
                return  # retired meanwhile: a newer version is out, which the wait reads
            writer = self._decode(value, latest[0])
            if not writer.buffers or writer.host != self._host:
                continue  # a writer elsewhere: its server's connection, or the timeout, tells
            pid = writer.buffers[0].pid
            if not writer.buffers[0].owner_alive():
                raise TensorStoreError(self._message(
                    f"{asked(key, version)}: rank {writer.rank} (pid {pid}), which wrote "
                    f"version {latest[0]}, has exited; no later version will come from it"))
