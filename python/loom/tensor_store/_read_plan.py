"""What a reader runs per read: the copies out of writers' buffers into its tensors, with
the sequence-lock checks around them (reused while the layout and the reader's tensors stay
the same), and the errors a read can end in."""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ._cancellation import stop_if_cancelled, touching_callers_tensors
from ._layout import flatten, shards_signature
from ._parts import MappedBuffer, PartMeta, TensorMeta, copy_groups, run_copies, unpickled

if TYPE_CHECKING:
    from ._remote import RemoteBuffer
    from ._store import TensorStore


class TensorStoreError(RuntimeError):
    """A version cannot be read: its writer exited or replaced it, or it was never complete."""


class Released(TensorStoreError):
    """A writer's buffer cannot be opened: the writer freed it (a newer put retired its version,
    or the writer closed its store) or exited."""


class Stale(Exception):
    """The version being read was rewritten while it was read (retried when reading latest);
    `copied`: whether copies into the reader's tensors had begun."""

    def __init__(self, copied: bool = True):
        super().__init__()
        self.copied = copied


class ReadPlan:
    """The copies one read makes (from writers' buffers into the reader's tensors) and the
    generation checks around them. A reader that fills the same state dict from the same
    layout again reuses it: no per-tensor work but the copies."""

    def __init__(self, store: "TensorStore", parts: list[PartMeta]):
        # Weakly: the store keeps its plans, and a cycle would keep the store's shared memory
        # until Python's cycle collector ran, not until its last reference went.
        self.store = weakref.proxy(store)
        self.parts = parts  # holds the layouts whose ids key the cache
        self.dsts: list[torch.Tensor] = []
        self.srcs: list[torch.Tensor] = []
        self.buffers: dict[tuple[int, int], MappedBuffer | RemoteBuffer] = {}  # (part, buffer) -> mapping
        self.objects: list[tuple[tuple, torch.Tensor]] = []
        self.result = None
        self.groups: list | None = None  # the copies grouped by devices, made on first run
        self.needs: list[tuple[tuple[int, int], int]] = []  # per copy: (part, buffer), end byte
        self.needs_for_objects: list[tuple[tuple[int, int], int]] = []
        self.ends: dict[tuple[int, int], int] = {}  # per buffer: the end of all it reads
        self.spans: dict[tuple[int, int], list[tuple[int, int]]] = {}  # per buffer: (offset, bytes) it reads
        self.ranges: dict[tuple[int, int], list[tuple[int, int]]] | None = None  # spans merged, on first run
        self.leaf_refs: list = []
        self.signature = b""  # shards_signature of the reader's tensors the plan was made for
        self.targets: list[torch.Tensor] = []  # the reader's own tensors this plan writes into
        self.guarded: list[torch.Tensor] = []  # those filled as copy_ fills (get's inplace_tensor)
        self.wait_limit = store._timeout  # for bytes still being written (set per read)
        self.deadline: float | None = None  # when the read that runs the plan gives up (monotonic)
        self.in_use = False  # a read runs it now (the store hands a cached plan to one read at a time)

    def _source(self, part: PartMeta, meta: TensorMeta) -> torch.Tensor:
        slot = (part.index, meta.buffer)
        mapped = self.buffers.get(slot)
        if mapped is None:
            mapped = self.buffers[slot] = self.store._mappings.buffer(part, meta.buffer)
        return mapped.view(meta.offset, meta.dtype, meta.box.shape)

    def copy(self, dst: torch.Tensor, part: PartMeta, meta: TensorMeta, narrow=None) -> None:
        """Plans dst.copy_(the stored piece), or of the block `narrow` picks out of it."""
        src = self._source(part, meta)
        self.dsts.append(dst)
        self.srcs.append(narrow(src) if narrow is not None else src)
        self._need(self.needs, part, meta)

    def _need(self, needs: list, part: PartMeta, meta: TensorMeta) -> None:
        slot, end = (part.index, meta.buffer), meta.offset + meta.nbytes
        needs.append((slot, end))
        self.ends[slot] = max(self.ends.get(slot, 0), end)
        if meta.nbytes:
            self.spans.setdefault(slot, []).append((meta.offset, meta.nbytes))

    def fill(self, target: torch.Tensor, into: torch.Tensor, like_copy: bool) -> None:
        """Notes that the copies write into the reader's own tensor `target` (through `into`,
        a DTensor's shard): each run bumps its version, as copy_ does; with `like_copy` it is
        also refused, as copy_ refuses it, if it requires grad while grad mode is on (a
        state dict's tensors are filled as load_state_dict fills them, under no_grad)."""
        self.targets.extend([target] if into is target else [target, into])
        if like_copy:
            self.guarded.append(target)

    def add_object(self, path: tuple, piece: tuple[PartMeta, TensorMeta]) -> None:
        self.objects.append((path, self._source(*piece)))
        self._need(self.needs_for_objects, *piece)

    def run(self, parts: list[PartMeta]) -> Any:
        """Copies, then keeps the result only if no buffer was rewritten meanwhile."""
        self._check_writable()
        with exclusive(self.buffers.values()):
            return self._copy_and_check(parts)

    def _copy_and_check(self, parts: list[PartMeta]) -> Any:
        """run() once the reader's tensors may be written and its buffers are its own."""
        checks = []
        writing = {}  # the buffers still being written, by (part, buffer)
        if self.ranges is None:
            self.ranges = {slot: merged(spans) for slot, spans in self.spans.items()}
        for (p, b), mapped in self.buffers.items():
            generation = parts[p].generations[b]
            checks.append((mapped, generation))
            # A buffer of a writer on another host fetches the bytes this read needs here.
            mapped.prepare(generation, self.ranges.get((p, b), []), parts[p], self.wait_limit, self._deadline())
            state = mapped.state(generation)
            if state == "replaced":
                raise Stale(copied=False)
            if state in ("writing", "pending"):
                writing[(p, b)] = (mapped, generation, parts[p])
        # From here on the caller's tensors (and dict) are written: a cancelled verb's cancel
        # waits for this to end, and one cancelled before it stops here.
        with touching_callers_tensors():
            # Under no_grad, as load_state_dict fills: with grad mode on, torch's copies (those
            # loom's own copies do not take, into a tensor that is not contiguous) refuse a leaf
            # that requires grad (a Parameter), and a state dict would be left half filled.
            # Whether such a tensor may be filled at all was settled by _check_writable, before
            # any byte moved.
            with torch.no_grad():
                if not writing:
                    if self.groups is None:
                        self.groups = copy_groups(self.dsts, self.srcs)
                    run_copies(self.groups)
                else:
                    self._run_as_written(writing)
            # loom's copies write memory behind autograd's back: a tensor saved for backward
            # must be seen as changed, as after copy_ (its backward then refuses to run).
            torch.autograd.graph.increment_version(self.targets)
            for slot, end in self.needs_for_objects:
                if slot in writing:
                    try:
                        self._await(writing[slot], end)
                    except (TensorStoreError, TimeoutError) as error:
                        error.while_copying = bool(self.dsts)  # the tensors are filled already
                        raise
            raw = {path: src.clone() for path, src in self.objects}
            for slot, (mapped, generation) in zip(self.buffers, checks):
                # Copied as written: valid as far as the write had got.
                written = self.ends[slot] if slot in writing else None
                if not mapped.check(generation, written):
                    raise Stale()
            return self.result({path: self._unpickled(parts[0], path, data) for path, data in raw.items()})

    def _unpickled(self, part: PartMeta, path: tuple, data: torch.Tensor) -> Any:
        """An object stored beside the tensors, or an error naming it (its class may exist in
        the writer's program only)."""
        try:
            return unpickled(data)
        except Exception as error:  # unpickling raises many kinds
            filled = "; the tensors this get was filling hold that version" if self.dsts else ""
            raise TensorStoreError(self.store._message(
                f"'{part.key}' version {part.version}: the object at {self.store._name(path)} cannot "
                f"be unpickled here ({type(error).__name__}: {error}): the reader must be able to "
                f"import what the writer stored{filled}")) from error

    def _check_writable(self) -> None:
        """Refuses, as copy_ does, to fill an inference tensor outside inference mode, and
        get's tensor if it requires grad while grad mode is on (torch.no_grad() around the
        read allows it)."""
        if not torch.is_inference_mode_enabled() and any(t.is_inference() for t in self.targets):
            raise RuntimeError(self.store._message(
                f"'{self.parts[0].key}': a tensor to fill is an inference tensor, which torch lets "
                f"no one change in place outside torch.inference_mode() (copy_ refuses too): read "
                f"inside inference_mode(), or into a tensor made outside it"))
        if not torch.is_grad_enabled():
            return
        for target in self.guarded:
            if target.requires_grad:
                raise RuntimeError(self.store._message(
                    f"'{self.parts[0].key}': the tensor to fill requires grad (a Parameter?) and grad "
                    f"mode is on; the store writes it in place, outside autograd, which copy_ "
                    f"refuses too: read under torch.no_grad(), or fill a state dict with "
                    f"get_state_dict, which fills as load_state_dict does"))

    def _run_as_written(self, writing: dict) -> None:
        """The copies in the order their bytes are written, each bucket once it is there."""
        order = sorted(range(len(self.dsts)), key=lambda i: self.needs[i][1])
        bucket = self.store._bucket_bytes
        start = 0
        while start < len(order):
            end, size = start, 0
            while end < len(order) and (end == start or size < bucket):
                size += self.dsts[order[end]].numel() * self.dsts[order[end]].element_size()
                end += 1
            chunk = order[start:end]
            for slot in {self.needs[i][0] for i in chunk}:
                if slot in writing:
                    try:
                        self._await(writing[slot], max(self.needs[i][1] for i in chunk if self.needs[i][0] == slot))
                    except (TensorStoreError, TimeoutError) as error:
                        # The buckets before this one are in the targets already.
                        error.while_copying = start > 0
                        raise
            run_copies(copy_groups([self.dsts[i] for i in chunk], [self.srcs[i] for i in chunk]), self.nbytes())
            start = end

    def nbytes(self) -> int:
        """The bytes this read copies into tensors."""
        return sum(d.numel() * d.element_size() for d in self.dsts)

    def _deadline(self) -> float:
        """When waits for a writer's bytes give up: the read's deadline, one for all of them
        (each bucket's wait once began a full timeout of its own, so a slow writer held a get
        far past it)."""
        if self.deadline is not None:
            return self.deadline
        return time.monotonic() + self.wait_limit.total_seconds()

    def _await(self, writing: tuple, end: int) -> None:
        """Waits until the writer has written the buffer up to byte `end` (or all of it)."""
        mapped, generation, part = writing
        deadline = self._deadline()
        checked = time.monotonic()
        pid = part.buffers[0].pid
        while True:
            state = mapped.state(generation)
            if state == "whole":
                return
            if state == "replaced":
                raise Stale()
            # Pending: the progress left is the previous write's, so it says nothing yet.
            if state == "writing" and mapped.progress() >= end:
                return
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(self.store._message(
                    f"'{part.key}' version {part.version}: rank {part.rank} did not finish writing "
                    f"it within {self.wait_limit}"))
            if now - checked > 0.1:
                checked = now
                # Cancelled, it stops here too, its tensors holding part of the version as
                # written so far: waiting on for the writer would hold the cancel up to the
                # get's timeout (the coroutine that cancelled it reads none of this get).
                stop_if_cancelled()
                if not part.buffers[0].owner_alive():
                    raise TensorStoreError(self.store._message(
                        f"'{part.key}' version {part.version}: rank {part.rank} (pid {pid}) died "
                        f"while writing it; the version before is still readable"))
            time.sleep(20e-6)

    def remember_leaves(self, leaves: dict[tuple, Any]) -> None:
        """Notes the reader's state dict this plan fills, for still_fits."""
        self.leaf_refs = [(path, weakref.ref(v) if isinstance(v, torch.Tensor) else None) for path, v in leaves.items()]
        self.signature = shards_signature([v for v in leaves.values() if isinstance(v, torch.Tensor)])

    def still_fits(self, user: dict) -> bool:
        """True if `user` holds the same tensors at the same names as when this was made, with
        the same memory, dtypes, shapes and strides (the copies hold views of that memory)."""
        leaves = list(flatten(user))
        if len(leaves) != len(self.leaf_refs):
            return False
        for (path, value), (known, ref) in zip(leaves, self.leaf_refs):
            if path != known or (ref() is not value if ref is not None else isinstance(value, torch.Tensor)):
                return False
        return shards_signature([v for _, v in leaves if isinstance(v, torch.Tensor)]) == self.signature


@contextlib.contextmanager
def exclusive(buffers):
    """Holds the locks of the buffers that have one (a RemoteBuffer: reads fetch into its one
    local copy, so a fetch, the copies out of it and the check are one read's at a time), in
    one order, so that reads sharing buffers cannot deadlock."""
    distinct = {id(b): b for b in buffers}.values()  # a lock is taken once
    locks = [b.lock for b in sorted(distinct, key=lambda b: b.region_id) if getattr(b, "lock", None) is not None]
    with contextlib.ExitStack() as stack:
        for lock in locks:
            stack.enter_context(lock)
        yield


def merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, bytes) spans sorted, touching or overlapping ones joined."""
    out: list[list[int]] = []
    for offset, size in sorted(spans):
        if out and offset <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], offset + size - out[-1][0])
        else:
            out.append([offset, size])
    return [(offset, size) for offset, size in out]


def pieces_by_path(parts: list[PartMeta]) -> dict[tuple, list[tuple[PartMeta, TensorMeta]]]:
    """Every stored piece, by its path."""
    entries: dict[tuple, list[tuple[PartMeta, TensorMeta]]] = {}
    for part in parts:
        for meta in part.tensors:
            entries.setdefault(meta.path, []).append((part, meta))
    return entries
