"""Which of a writer's kept versions go to make room for a put, and what goes with them:
their Store entries, and, for a DTensor mesh whose versions complete only when every rank's
part is written, the versions a rank's failed part abandoned. TensorStore inherits it."""

from __future__ import annotations

import collections

from ._read_plan import TensorStoreError
from ._version_waits import ABANDONED
from ._write_plan import Kept


class Retirement:
    """The retirement of kept versions; TensorStore supplies _store, _keep, _abandoned,
    _latest, _get_now and _message."""

    def _retiring(self, key: str, kept: collections.deque, writers: list[int]) -> list[Kept]:
        """The kept versions to retire so that this put leaves `keep`, oldest first, never the
        latest complete one. A single writer's kept versions are all complete. A mesh rank's
        may not be: the version after the latest complete one may still be written by a slower
        rank (retiring this rank's part of it would leave readers of the latest a version they
        cannot read once it completes), or a rank's part of it failed (it never completes; its
        done count was pushed past the parts: _abandon). Those still awaited are kept beyond
        `keep`, up to twice it: further ahead than that, the put is refused by name."""
        if len(writers) == 1:
            return list(kept)[:max(0, len(kept) - self._keep + 1)]
        found = self._latest(key)
        latest = found[0] if found else 0
        self._forget_abandoned(key, latest)
        excess = len(kept) - self._keep + 1
        if excess <= 0:
            return []
        # The done counts of those after the latest this put found: equal to the parts once
        # complete (one may have completed since: it is the latest now), ABANDONED or more
        # once abandoned, below the parts while awaited, missing once rank 0 of the mesh
        # retired it.
        done = {}
        for old in kept:
            if old.version > latest:
                count = self._get_now(f"k/{key}/v{old.version}/done")
                done[old.version] = None if count is None else int(count)
                if done[old.version] == old.parts:
                    latest = max(latest, old.version)
        awaited = [old for old in kept if old.version > latest
                   and done[old.version] is not None and done[old.version] < old.parts]
        waiting = {old.version for old in awaited}
        retiring = [old for old in kept if old.version != latest and old.version not in waiting]
        if len(kept) - len(retiring) >= 2 * self._keep:
            oldest = awaited[0]
            base = f"k/{key}/v{oldest.version}"
            missing = [rank for index, rank in enumerate(writers)
                       if self._get_now(f"{base}/p{index}") is None]
            raise TensorStoreError(self._message(
                f"put('{key}'): this rank's mesh has not completed version {oldest.version} nor any "
                f"of the {len(awaited) - 1} after it that this rank put (global ranks {missing} have "
                f"not published their parts of it): they are behind by more than the {self._keep} "
                f"versions kept, or stopped; put from every rank of the mesh in step"))
        return retiring[:excess]

    def _abandon(self, key: str, version: int) -> None:
        """Says a mesh's version will never be complete (this rank's part of it failed): its
        done count goes past any number of parts, so no rank's count can complete it, the
        mesh's other ranks may retire their parts of it (_retiring), and readers waiting for
        it are told (_wait). Its entries go once a later version is complete
        (_forget_abandoned)."""
        self._store.add(f"k/{key}/v{version}/done", ABANDONED)
        self._abandoned.setdefault(key, []).append(version)

    def _forget_abandoned(self, key: str, latest: int) -> None:
        """Deletes the done count and writers record of versions of `key` this rank abandoned
        below `latest`: nobody waits for those any more (a reader waiting for one was told the
        writers went on past it), and no writer may take their numbers (they are below the
        latest). Without this each failed part would leave two Store entries for good."""
        below = [v for v in self._abandoned.get(key, []) if v < latest]
        for version in below:
            self._store.delete_key(f"k/{key}/v{version}/done")
            self._store.delete_key(f"k/{key}/v{version}/writers")
        if below:
            self._abandoned[key] = [v for v in self._abandoned[key] if v >= latest]

    def _unpublish(self, key: str, kept: Kept) -> None:
        base = f"k/{key}/v{kept.version}"
        self._store.delete_key(f"{base}/p{kept.index}")
        if kept.index == 0:
            self._store.delete_key(f"{base}/complete")
            self._store.delete_key(f"{base}/writers")
            # A single writer never counts its parts. An abandoned version's count stays (a
            # few bytes per failed part): a reader waiting for it learns from it that it never
            # comes, where the version's parts it waits for are gone.
            done = self._get_now(f"{base}/done") if kept.parts > 1 else None
            if done is not None and int(done) < ABANDONED:
                self._store.delete_key(f"{base}/done")
