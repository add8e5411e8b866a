"""TensorStore: put/get of tensors, objects and state dicts between the processes of a job.

Keys in the job's Store (under loom_ts/<namespace>/), all small:
    k/<key>/latest           the newest complete version
    k/<key>/v<V>/p<i>        part i of version V (a PartMeta: where its bytes are)
    k/<key>/v<V>/done        how many parts of V are published (Store.add)
    k/<key>/v<V>/complete    the number of parts, set by the writer that completed V
    index                    every key ever put, one per line (the Store cannot list keys)

A version is readable once it is complete, and readers copy it with a sequence-lock check
(src/transport/shm/region.h), so a reader never keeps bytes of a version that was being
rewritten. A writer keeps its last `keep` versions (at least 2): a put never touches the
previous version, so a writer that fails or dies in the middle of a put leaves it readable.
"""

from __future__ import annotations

import collections
import math
import os
import threading
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Iterable

import torch
import torch.distributed as dist

from ._layout import Box, dtensor_box, flatten, is_dtensor, is_first_replica, path_text, unflatten, whole
from ._parts import (
    BufferMeta,
    MappedBuffer,
    OwnedBuffer,
    PartMeta,
    TensorMeta,
    aligned,
    host_identity,
    pickled_tensor,
    typed_view,
    unpickled,
)


class TensorStoreError(RuntimeError):
    """A version cannot be read: its writer exited or replaced it, or it was never complete."""


class _Stale(Exception):
    """The version being read was rewritten while it was read (retried when reading latest)."""


@dataclass
class _Kept:
    version: int
    index: int
    buffers: list[OwnedBuffer]


class TensorStore:
    """Put/get of tensors, DTensors, objects and state dicts, bytes moving straight from the
    writer's memory to the reader's (see docs/STORE.md).

    `store` is the job's c10d Store (default: the default process group's); `namespace`
    separates independent stores of one job; a writer keeps its last `keep` versions of each
    key readable; `timeout` bounds waits for a version (default: the Store's timeout)."""

    _RETRIES = 8  # reads of "latest" that raced a newer put, before giving up

    def __init__(self, store: dist.Store | None = None, *, namespace: str = "default", keep: int = 2,
                 timeout: timedelta | None = None, rank: int | None = None):
        if store is None:
            if not dist.is_initialized():
                raise RuntimeError("loom tensor store: pass a c10d Store, or call "
                                   "torch.distributed.init_process_group() first")
            store = dist.distributed_c10d._get_default_store()
        if keep < 2:
            raise ValueError(f"loom tensor store: keep={keep}; at least 2 versions must be kept, so "
                             f"that a put never overwrites the version readers may be reading")
        self._store = dist.PrefixStore(f"loom_ts/{namespace}/", store)
        self._rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self._keep = keep
        self._timeout = timeout if timeout is not None else store.timeout
        self._host = host_identity()
        self._lock = threading.RLock()
        self._owned: dict[str, collections.deque[_Kept]] = {}
        self._last_version: dict[str, int] = {}
        self._indexed: set[str] = set()
        self._mapped: dict[str, MappedBuffer] = {}  # by region id
        self._reading: dict[tuple, collections.deque] = {}  # (key, part, buffer) -> region ids, newest first
        self._closed = False

    # ---- the verbs -------------------------------------------------------------------------

    def put(self, key: str, value: Any, *, version: int | None = None) -> int:
        """Stores `value` (a tensor, a DTensor or any picklable object) as a new version of
        `key`; returns the version. A DTensor is put by every rank of its mesh, each storing
        its own shard (replicas store once)."""
        kind = "tensor" if isinstance(value, torch.Tensor) else "object"
        return self._put_leaves(key, kind, [((), value)], version)

    def get(self, key: str, inplace_tensor: torch.Tensor | None = None, tensor_slice_spec: Any = None, *,
            version: int | None = None, timeout: timedelta | None = None) -> Any:
        """The value of `key` at `version` (default: the latest). A tensor is assembled from
        every stored shard: the whole tensor, or into `inplace_tensor` (a tensor of the whole
        shape, or a DTensor, which receives its own shard), or the block `tensor_slice_spec`
        names (offsets and local_shape). A version not yet put is waited for up to `timeout`."""
        self._check_key(key)
        with self._lock:
            return self._read(key, version, timeout,
                              lambda v, entries: self._materialise(key, v, entries, inplace_tensor, tensor_slice_spec))

    def put_state_dict(self, state_dict: dict, key: str, *, version: int | None = None) -> int:
        """Stores a (nested) state dict as one version of `key`, packed into one buffer per
        device. With DTensors in it, every rank of their mesh calls this with its shards."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"loom tensor store: put_state_dict('{key}') needs a dict, got {type(state_dict).__name__}")
        return self._put_leaves(key, "state_dict", list(flatten(state_dict)), version)

    def get_state_dict(self, key: str, user_state_dict: dict | None = None, *, version: int | None = None,
                       timeout: timedelta | None = None, strict: bool = True) -> dict:
        """The state dict stored under `key`. With `user_state_dict`, its tensors are filled in
        place (a DTensor receives its own shard, resharded from however the writers held it)
        and it is returned with its other leaves replaced; `strict` refuses names that only
        one side has, as load_state_dict does."""
        self._check_key(key)
        with self._lock:
            return self._read(key, version, timeout,
                              lambda v, entries: self._fill_state_dict(key, v, entries, user_state_dict, strict))

    def put_batch(self, items: dict[str, Any], *, version: int | None = None) -> dict[str, int]:
        """put() of every key of `items`; returns each key's version."""
        return {key: self.put(key, value, version=version) for key, value in items.items()}

    def get_batch(self, keys: Iterable[str] | dict[str, torch.Tensor | None], *,
                  version: int | None = None) -> dict[str, Any]:
        """get() of every key (a dict maps keys to their in-place tensors)."""
        targets = keys if isinstance(keys, dict) else {key: None for key in keys}
        return {key: self.get(key, inplace, version=version) for key, inplace in targets.items()}

    def delete(self, key: str) -> None:
        """Removes `key`: readers find it no more, and this process frees its buffers for it."""
        self._check_key(key)
        with self._lock:
            latest = self._latest(key)
            if latest is None and key not in self._owned:
                raise KeyError(self._message(f"delete('{key}'): no such key"))
            self._store.delete_key(f"k/{key}/latest")
            for kept in self._owned.pop(key, ()):
                self._unpublish(key, kept)
            self._last_version.pop(key, None)

    def exists(self, key: str) -> bool:
        """True if some version of `key` is readable."""
        self._check_key(key)
        return self._latest(key) is not None

    def keys(self, prefix: str | None = None) -> list[str]:
        """The readable keys (those starting with `prefix`), sorted."""
        if not self._store.check(["index"]):
            return []
        names = {name for name in self._store.get("index").decode().split("\n") if name}
        return sorted(n for n in names if (prefix is None or n.startswith(prefix)) and self.exists(n))

    def latest_version(self, key: str) -> int | None:
        """The newest complete version of `key`, or None if there is none."""
        self._check_key(key)
        return self._latest(key)

    def close(self) -> None:
        """Frees this process's buffers. Versions it wrote stay listed; readers that have not
        copied them get an error naming this rank."""
        with self._lock:
            self._owned.clear()
            self._mapped.clear()
            self._reading.clear()
            self._closed = True

    def __enter__(self) -> "TensorStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- writing --------------------------------------------------------------------------

    def _put_leaves(self, key: str, kind: str, leaves: list[tuple[tuple, Any]], version: int | None) -> int:
        self._check_key(key)
        writers, index = self._writers(key, leaves)
        pieces: list[tuple[TensorMeta, torch.Tensor]] = []
        for path, value in leaves:
            if is_dtensor(value):
                box, global_shape = self._dtensor_box(value, self._what(key, path))
                if is_first_replica(value):
                    pieces.append((TensorMeta(path, value.dtype, box, global_shape, 0, 0), value.to_local()))
            elif index != 0:
                continue  # plain tensors and objects are stored once, by the first writer
            elif isinstance(value, torch.Tensor):
                pieces.append((TensorMeta(path, value.dtype, whole(value.shape), tuple(value.shape), 0, 0), value.detach()))
            else:
                data = pickled_tensor(value)
                pieces.append((TensorMeta(path, torch.uint8, whole(data.shape), tuple(data.shape), 0, 0, pickled=True), data))
        with self._lock:
            if self._closed:
                raise RuntimeError(self._message(f"put('{key}'): this TensorStore is closed"))
            version = self._next_version(key, version)
            return self._publish(key, kind, version, index, len(writers), pieces)

    def _writers(self, key: str, leaves: list[tuple[tuple, Any]]) -> tuple[list[int], int]:
        """The ranks that put this version together (a DTensor's mesh), and this rank's place."""
        meshes = [value.device_mesh for _, value in leaves if is_dtensor(value)]
        if not meshes:
            return [self._rank], 0
        writers = meshes[0].mesh.flatten().tolist()
        for mesh in meshes[1:]:
            if sorted(mesh.mesh.flatten().tolist()) != sorted(writers):
                raise ValueError(self._message(
                    f"put('{key}'): its DTensors live on meshes of different ranks "
                    f"({sorted(writers)} and {sorted(mesh.mesh.flatten().tolist())}); one key is "
                    f"put by one set of ranks: split it into one key per mesh"))
        if self._rank not in writers:
            raise ValueError(self._message(f"put('{key}'): this rank is not in its DTensors' mesh {writers}"))
        return writers, writers.index(self._rank)

    def _next_version(self, key: str, version: int | None) -> int:
        last = self._last_version.get(key)
        if last is None and key not in self._owned:
            last = self._latest(key) or 0
        if version is None:
            return last + 1
        if not isinstance(version, int) or version <= (last or 0):
            raise ValueError(self._message(
                f"put('{key}', version={version}): versions must be integers that grow; the last "
                f"version of this key is {last}"))
        return version

    def _publish(self, key: str, kind: str, version: int, index: int, parts: int,
                 pieces: list[tuple[TensorMeta, torch.Tensor]]) -> int:
        # Lay the pieces out, one buffer per device.
        layout: dict[torch.device, int] = {}
        placed: dict[torch.device, list[tuple[torch.Tensor, int]]] = {}
        metas = []
        for meta, tensor in pieces:
            device = tensor.device
            offset = layout.get(device, 0)
            layout[device] = offset + aligned(meta.nbytes)
            placed.setdefault(device, []).append((tensor, offset))
            metas.append((meta, device, offset))
        devices = sorted(layout, key=str)
        kept = self._owned.setdefault(key, collections.deque())
        spare: list[OwnedBuffer] = []
        while len(kept) >= self._keep:  # the oldest version goes; its buffers may be reused
            oldest = kept.popleft()
            self._unpublish(key, oldest)
            spare.extend(oldest.buffers)
        buffers = [self._buffer(key, device, layout[device], spare) for device in devices]
        del spare  # buffers not reused are freed here
        part = PartMeta(key=key, version=version, index=index, parts=parts, rank=self._rank, host=self._host, kind=kind)
        for device, buffer in zip(devices, buffers):
            part.buffers.append(buffer.meta(buffer.write(placed[device])))
        for meta, device, offset in metas:
            part.tensors.append(replace(meta, buffer=devices.index(device), offset=offset))
        kept.append(_Kept(version, index, buffers))
        self._last_version[key] = version
        self._store.set(f"k/{key}/v{version}/p{index}", part.encode())
        if self._store.add(f"k/{key}/v{version}/done", 1) == parts:
            self._store.set(f"k/{key}/v{version}/complete", str(parts))
            self._advance_latest(key, version)
        if key not in self._indexed:
            self._store.append("index", key + "\n")
            self._indexed.add(key)
        return version

    def _buffer(self, key: str, device: torch.device, capacity: int, spare: list[OwnedBuffer]) -> OwnedBuffer:
        """A buffer of at least `capacity` bytes on `device`: a spare one of the retired
        version if one fits (no new pages to fault in), else a new one."""
        fitting = [b for b in spare if b.device == device and capacity <= b.capacity <= 2 * capacity + 4096]
        if fitting:
            best = min(fitting, key=lambda b: b.capacity)
            spare.remove(best)
            return best
        if device.type == "cpu":
            available = _available_memory()
            if available is not None and capacity > available:
                raise MemoryError(self._message(
                    f"put('{key}') needs {capacity} bytes of shared memory and this host has "
                    f"{available} available: put less, or free memory (each key keeps "
                    f"{self._keep} versions)"))
        return OwnedBuffer(device, capacity)

    def _advance_latest(self, key: str, version: int) -> None:
        name = f"k/{key}/latest"
        current = self._store.get(name).decode() if self._store.check([name]) else ""
        while not current or int(current) < version:  # compare-and-set: latest only grows
            seen = self._store.compare_set(name, current, str(version)).decode()
            if seen == str(version):
                return
            current = seen

    def _unpublish(self, key: str, kept: _Kept) -> None:
        base = f"k/{key}/v{kept.version}"
        self._store.delete_key(f"{base}/p{kept.index}")
        if kept.index == 0:
            self._store.delete_key(f"{base}/complete")
            self._store.delete_key(f"{base}/done")

    # ---- reading --------------------------------------------------------------------------

    def _latest(self, key: str) -> int | None:
        name = f"k/{key}/latest"
        if not self._store.check([name]):
            return None
        return int(self._store.get(name))

    def _read(self, key: str, version: int | None, timeout: timedelta | None, consume) -> Any:
        """Runs consume(version, entries) on a complete version until it reads one that was
        not rewritten meanwhile. `entries` maps each path to its stored pieces."""
        for _ in range(self._RETRIES):
            v, parts = self._parts(key, version, timeout)
            entries: dict[tuple, list[tuple[PartMeta, TensorMeta]]] = {}
            for part in parts:
                for meta in part.tensors:
                    entries.setdefault(meta.path, []).append((part, meta))
            try:
                return consume(v, entries)
            except _Stale:
                if version is not None:
                    raise TensorStoreError(self._message(
                        f"get('{key}', version={version}): the writer replaced that version while "
                        f"it was read (it keeps {self._keep}); read it sooner, or ask for the "
                        f"latest")) from None
        raise TensorStoreError(self._message(
            f"get('{key}'): {self._RETRIES} newer versions were put while reading the latest; "
            f"the writer puts faster than this rank can read"))

    def _parts(self, key: str, version: int | None, timeout: timedelta | None) -> tuple[int, list[PartMeta]]:
        latest = self._latest(key)
        if version is None:
            if latest is None:
                raise KeyError(self._message(f"get('{key}'): no such key (put it first; keys() lists the readable ones)"))
            version = latest
        complete = f"k/{key}/v{version}/complete"
        if not self._store.check([complete]):
            if latest is not None and version <= latest:
                raise TensorStoreError(self._message(
                    f"get('{key}', version={version}): that version is no longer kept (the "
                    f"latest is {latest}; writers keep their last {self._keep})"))
            wait = timeout if timeout is not None else self._timeout
            try:
                self._store.wait([complete], wait)
            except Exception as error:  # the Store raises its own error types on timeout
                raise TimeoutError(self._message(
                    f"get('{key}', version={version}): not put within {wait} (latest: {latest})")) from error
        parts = int(self._store.get(complete))
        metas = []
        for index in range(parts):
            name = f"k/{key}/v{version}/p{index}"
            if not self._store.check([name]):  # retired since `complete` was read
                if version == latest:
                    raise TensorStoreError(self._message(f"get('{key}'): version {version} vanished while read"))
                return self._parts(key, None, timeout)
            metas.append(PartMeta.decode(self._store.get(name)))
        return version, metas

    def _mapped_buffer(self, part: PartMeta, which: int) -> MappedBuffer:
        meta = part.buffers[which]
        if part.host != self._host:
            raise TensorStoreError(self._message(
                f"'{part.key}' version {part.version} was put by rank {part.rank} on another host; "
                f"reading across hosts is not built yet (the store reads within one host)"))
        slot = (part.key, part.index, which)
        mapped = self._mapped.get(meta.region_id)
        if mapped is None:
            try:
                mapped = MappedBuffer(meta)
            except RuntimeError as error:
                raise TensorStoreError(self._message(
                    f"'{part.key}' version {part.version}: cannot open the buffer of rank "
                    f"{part.rank} (pid {meta.pid}): {error}")) from error
            self._mapped[meta.region_id] = mapped
        # A writer rotates `keep` buffers per key: keep as many mappings of each (mapping one
        # again means faulting in all its pages), and drop the least recently used beyond.
        recent = self._reading.setdefault(slot, collections.deque())
        if meta.region_id in recent:
            recent.remove(meta.region_id)
        recent.appendleft(meta.region_id)
        while len(recent) > self._keep:
            self._mapped.pop(recent.pop(), None)
        return mapped

    def _copier(self):
        """Collects copies out of writers' buffers, then checks that none was rewritten."""
        store = self
        used: dict[str, tuple[MappedBuffer, int]] = {}

        class Copier:
            def source(self, part: PartMeta, meta: TensorMeta) -> torch.Tensor:
                buffer_meta = part.buffers[meta.buffer]
                mapped = store._mapped_buffer(part, meta.buffer)
                if not mapped.whole_at(buffer_meta.generation):
                    raise _Stale()
                used[buffer_meta.region_id] = (mapped, buffer_meta.generation)
                return typed_view(mapped.data, meta.offset, meta.dtype, meta.box.shape)

            def verify(self) -> None:
                for mapped, generation in used.values():
                    if not mapped.check(generation):
                        raise _Stale()

        return Copier()

    def _assemble(self, key: str, version: int, path: tuple, pieces, want: Box, dst: torch.Tensor, copier) -> None:
        """Copies block `want` of the tensor at `path` into `dst` from every piece over it."""
        covered = 0
        for part, meta in pieces:
            block = want.overlap(meta.box)
            if block is None:
                continue
            src = copier.source(part, meta)
            block.view_of(dst, want).copy_(block.view_of(src, meta.box))
            covered += block.numel
        if covered != want.numel:
            raise TensorStoreError(self._message(
                f"'{key}' version {version}: the stored shards of {self._name(path)} cover {covered} of the "
                f"{want.numel} elements asked for (writers put overlapping or missing shards)"))

    def _target(self, key: str, version: int, path: tuple, pieces, dst: Any, slice_spec: Any) -> tuple[Box, torch.Tensor]:
        """The block to read and the tensor receiving it, after checking dtype and shape."""
        stored = pieces[0][1]
        what = f"'{key}' version {version}, {self._name(path)}"
        if stored.pickled:
            raise ValueError(self._message(f"{what} is an object, not a tensor: get it without a tensor to fill"))
        if dst is not None and dst.dtype != stored.dtype:
            raise ValueError(self._message(f"{what} is stored as {stored.dtype}; the tensor to fill is {dst.dtype}"))
        if dst is not None and is_dtensor(dst):
            want, global_shape = self._dtensor_box(dst, what)
            if global_shape != stored.global_shape:
                raise ValueError(self._message(f"{what} has global shape {list(stored.global_shape)}; the DTensor to fill has {list(global_shape)}"))
            return want, dst.to_local()
        if slice_spec is not None:
            offsets, shape = _slice_of(slice_spec)
            want = Box(offsets, shape)
            if len(shape) != len(stored.global_shape) or any(
                    o < 0 or o + n > g for o, n, g in zip(offsets, shape, stored.global_shape)):
                raise ValueError(self._message(f"{what}: the slice at {list(offsets)} of shape {list(shape)} is not within its shape {list(stored.global_shape)}"))
        else:
            want = whole(stored.global_shape)
        if dst is None:
            device = pieces[0][0].buffers[stored.buffer].device
            if device == "cuda" and not torch.cuda.is_available():
                device = "cpu"
            return want, torch.empty(want.shape, dtype=stored.dtype, device=device)
        if tuple(dst.shape) != want.shape:
            raise ValueError(self._message(f"{what}: the tensor to fill has shape {list(dst.shape)}; the stored block is {list(want.shape)}"))
        return want, dst

    def _materialise(self, key: str, version: int, entries, inplace: Any, slice_spec: Any) -> Any:
        pieces = entries.get(())
        if pieces is None:
            return self._fill_state_dict(key, version, entries, None, strict=True)
        copier = self._copier()
        if pieces[0][1].pickled:
            if inplace is not None:
                raise ValueError(self._message(f"'{key}' version {version} is an object, not a tensor: get it without inplace_tensor"))
            data = copier.source(*pieces[0]).clone()
            copier.verify()
            return unpickled(data)
        want, dst = self._target(key, version, (), pieces, inplace, slice_spec)
        self._assemble(key, version, (), pieces, want, dst, copier)
        copier.verify()
        return inplace if inplace is not None else dst

    def _fill_state_dict(self, key: str, version: int, entries, user: dict | None, strict: bool) -> dict:
        copier = self._copier()
        objects: dict[tuple, torch.Tensor] = {}
        if user is None:
            leaves: dict[tuple, Any] = {}
            for path, pieces in entries.items():
                if pieces[0][1].pickled:
                    objects[path] = copier.source(*pieces[0]).clone()
                else:
                    want, dst = self._target(key, version, path, pieces, None, None)
                    self._assemble(key, version, path, pieces, want, dst, copier)
                    leaves[path] = dst
        else:
            leaves = dict(flatten(user))
            if strict:
                missing = [self._name(p) for p in leaves if p not in entries]
                unexpected = [self._name(p) for p in entries if p not in leaves]
                if missing or unexpected:
                    raise KeyError(self._message(
                        f"get_state_dict('{key}') version {version}: names differ (strict=True): "
                        f"not stored: {missing[:8]}{'...' if len(missing) > 8 else ''}; stored but "
                        f"not asked for: {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"))
            for path, value in list(leaves.items()):
                pieces = entries.get(path)
                if pieces is None:
                    continue
                if pieces[0][1].pickled:
                    objects[path] = copier.source(*pieces[0]).clone()
                    continue
                dst = value if isinstance(value, torch.Tensor) else None
                want, into = self._target(key, version, path, pieces, dst, None)
                self._assemble(key, version, path, pieces, want, into, copier)
                leaves[path] = value if dst is not None else into
        copier.verify()
        for path, data in objects.items():
            leaves[path] = unpickled(data)
        return unflatten(leaves)

    # ---- messages -------------------------------------------------------------------------

    def _check_key(self, key: Any) -> None:
        if not isinstance(key, str) or not key or "\n" in key:
            raise ValueError(self._message(f"key {key!r}: keys are non-empty strings without newlines"))

    def _dtensor_box(self, value: Any, what: str) -> tuple[Box, tuple[int, ...]]:
        try:
            return dtensor_box(value, what)
        except ValueError as error:
            raise ValueError(self._message(str(error))) from None

    def _message(self, text: str) -> str:
        return f"loom tensor store (rank {self._rank}): {text}"

    @staticmethod
    def _name(path: tuple) -> str:
        return f"'{path_text(path)}'" if path else "the value"

    def _what(self, key: str, path: tuple) -> str:
        return f"'{key}'" + (f" entry '{path_text(path)}'" if path else "")


def _slice_of(spec: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) from a slice spec: torchstore's TensorSlice (offsets, local_shape) or
    a pair."""
    if hasattr(spec, "offsets") and hasattr(spec, "local_shape"):
        return tuple(int(o) for o in spec.offsets), tuple(int(n) for n in spec.local_shape)
    offsets, shape = spec
    return tuple(int(o) for o in offsets), tuple(int(n) for n in shape)


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
