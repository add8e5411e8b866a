"""TensorStore: put/get of tensors, objects and state dicts between the processes of a job.

Keys in the job's Store (under loom_ts/<namespace>/), all small:
    k/<key>/latest           "<version>/<parts>" of the newest complete version; for a lent key
                             "<version>/1/<part>": the part itself (lent keys have no others)
    k/<key>/v<V>/p<i>        part i of version V: its buffers' generations, then its layout
                             (a pickled PartMeta: where its bytes are), set before the bytes
    k/<key>/v<V>/done        how many parts of V are written (Store.add; several writers only)
    k/<key>/v<V>/complete    the number of parts, set by the writer that completed V
    k/<key>/mode             "put" or "lent", set with every part (put) or lend, so that it is
                             back as soon as a key some other rank deleted is put again
    k/<key>/v<V>/writers     who put V, set first by compare-and-set (a second writer of the
                             same number is refused): one writer (a TensorStore of one
                             process: "<rank>|<pid>@<host>#<store>"), or a DTensor's mesh
                             ("<rank>,<rank>,...", the same on every rank of it)
    index                    every key ever put, one per line (the Store cannot list keys)

Readers of the latest see a version once it is complete; a reader that asks for a version
by number may copy it bucket by bucket as it is written. Either way readers copy with a
sequence-lock check (src/transport/shm/region.h), so a reader never keeps bytes of a version
that was being rewritten. A writer keeps its last `keep` versions (at least 2): a put never touches the
previous version, so a writer that fails or dies in the middle of a put leaves it readable.

A lent key (lend_state_dict) publishes the writer's own tensors, moved once into a store
buffer by make_lendable, instead of a copy: one version at a time, readable until the writer
reclaims it to change them (the buffer's generation turns odd); readers of the latest then
wait for the next lend.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import pickle
import threading
import time
import weakref
from dataclasses import replace
from datetime import timedelta
from typing import Any, Iterable

import torch
import torch.distributed as dist

from ._arguments import as_timeout, is_version_number
from ._broadcast import Broadcaster
from ._cancellation import stop_if_cancelled, touching_callers_tensors
from ._layout import (Box, dtensor_box, flatten, is_dtensor, is_first_replica, leaf_signature, path_text,
                      unstorable, whole)
from ._lending import Lent, home_of, lendable_tensors, lent_metas, move_to_new_buffers, take_back
from ._mappings import ReaderMappings
from ._read_plan import ReadPlan, Released, Stale, TensorStoreError
from ._read_planning import ReadPlanning
from ._remote import serve
from ._retirement import Retirement
from ._verbs import asked, called_verb, calling_as
from ._version_waits import VersionWaits
from ._write_plan import Kept, WritePlan
from ._parts import (
    OwnedBuffer,
    PartMeta,
    TensorMeta,
    encode_part,
    split_part,
    host_identity,
    pickled_tensor,
)


# A value no key of the store ever holds (see TensorStore._get_now).
_ABSENT = b"\x00loom-tensor-store: absent\x00"
# Numbers the TensorStores of this process: with its pid and host, a writer's identity.
_SERIALS = itertools.count()

class TensorStore(ReadPlanning, VersionWaits, Retirement):
    """Put/get of tensors, DTensors, objects and state dicts, bytes moving straight from the
    writer's memory to the reader's (see docs/STORE.md).

    `store` is the job's c10d Store (default: the default process group's); `namespace`
    separates independent stores of one job; a writer keeps its last `keep` versions of each
    key readable; `timeout` bounds waits for a version (default: the Store's timeout); a put
    writes `bucket_bytes` at a time, and a reader that asked for that version copies each
    bucket as soon as it is written; `serve_remote` (default True) serves this process's
    buffers to readers on other hosts over loom's network transport (False keeps them to
    this host, with no network listener). `rank` names this process in messages and parts
    (default: its rank in the default process group, else 0); it need not be unique: which
    writer put a version is told by its TensorStore, process and host."""

    _RETRIES = 8  # reads of "latest" that raced a newer put, before giving up

    def __init__(self, store: dist.Store | None = None, *, namespace: str = "default", keep: int = 2,
                 timeout: timedelta | None = None, rank: int | None = None, bucket_bytes: int = 64 << 20,
                 serve_remote: bool = True):
        if store is None:
            if not dist.is_initialized():
                raise RuntimeError("loom tensor store: pass a c10d Store, or call "
                                   "torch.distributed.init_process_group() first")
            store = dist.distributed_c10d._get_default_store()
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 2:
            raise ValueError(f"loom tensor store: keep={keep!r}; an int of at least 2 (versions kept), so "
                             f"that a put never overwrites the version readers may be reading")
        self._store = dist.PrefixStore(f"loom_ts/{namespace}/", store)
        self._job_store = store  # the byte fetch's credentials are the job's, whatever the namespace
        self._serve_remote = serve_remote
        self._rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self._keep = keep
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
            raise ValueError(f"loom tensor store: bucket_bytes={bucket_bytes!r}; a positive number of "
                             f"bytes (the default, 64 MiB, copies a version a bucket at a time)")
        self._bucket_bytes = bucket_bytes
        self._timeout = as_timeout(timeout, "loom tensor store") if timeout is not None else store.timeout
        self._host = host_identity()
        self._serial = next(_SERIALS)
        # Guards this store's state (kept versions, plans, mappings) for verbs on several
        # threads (AsyncTensorStore). Never held across a wait for another process (a version
        # not put yet, a writer's bytes, a collective): one verb's wait must not stop others.
        self._lock = threading.RLock()
        self._broadcasting = threading.Lock()  # one broadcast at a time: they share plans
        self._owned: dict[str, collections.deque[Kept]] = {}
        self._last_version: dict[str, int] = {}
        self._abandoned: dict[str, list[int]] = {}  # mesh versions this rank's part failed (_abandon)
        self._indexed: set[str] = set()
        self._latest_seen: dict[str, bytes] = {}  # the latest value this writer set, per key
        self._write_plans: dict[str, WritePlan] = {}
        self._read_plans: dict[str, dict[tuple, ReadPlan]] = {}
        self._layouts: dict[bytes, PartMeta] = {}  # decoded part layouts, by their bytes
        # What the mappings call back, held weakly (as ReadPlan holds the store): a store
        # dropped without close() frees its shared memory with its last reference.
        me = weakref.ref(self)
        self._mappings = ReaderMappings(keep, self._host, store, lambda text: me()._message(text),
                                        lambda key: me()._read_plans.pop(key, None))
        self._lendable: list[OwnedBuffer] = []  # buffers make_lendable moved tensors into
        self._lent: dict[str, Lent] = {}  # keys this writer lends, by key
        self._broadcaster = Broadcaster(self._bucket_bytes)  # broadcast mode's plans and versions
        self._closed = False

    # ---- the verbs -------------------------------------------------------------------------

    def put(self, key: str, value: Any, *, version: int | None = None) -> int:
        """Stores `value` (a tensor, a DTensor or any picklable object) as a new version of
        `key`; returns the version. A DTensor is put by every rank of its mesh, each storing
        its own shard (replicas store once)."""
        kind = "tensor" if isinstance(value, torch.Tensor) else "object"
        with calling_as("put"):  # the write's messages name the verb called
            return self._put_leaves(key, kind, [((), value)], version)

    def get(self, key: str, inplace_tensor: torch.Tensor | None = None, tensor_slice_spec: Any = None, *,
            version: int | None = None, timeout: timedelta | None = None) -> Any:
        """The value of `key` at `version` (default: the latest). A tensor is assembled from
        every stored shard: the whole tensor, or into `inplace_tensor` (a tensor of the whole
        shape, or a DTensor, which receives its own shard), or the block `tensor_slice_spec`
        names (offsets and local_shape). A version not yet put is waited for up to `timeout`.
        `inplace_tensor` is filled as copy_ would: under torch.no_grad() if it requires grad."""
        self._check_key(key)
        if inplace_tensor is not None and not isinstance(inplace_tensor, torch.Tensor):
            raise TypeError(self._message(f"get('{key}'): inplace_tensor is a tensor to fill (or None), "
                                          f"got {type(inplace_tensor).__name__}"))
        return self._read(key, version, timeout,
                          lambda v, parts: self._value_plan(key, v, parts, inplace_tensor, tensor_slice_spec),
                          fills=inplace_tensor is not None)

    def put_state_dict(self, state_dict: dict, key: str, *, version: int | None = None) -> int:
        """Stores a (nested) state dict as one version of `key`, packed into one buffer per
        device. With DTensors in it, every rank of their mesh calls this with its shards."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"loom tensor store: put_state_dict('{key}') needs a dict, got {type(state_dict).__name__}")
        with calling_as("put_state_dict"):
            return self._put_leaves(key, "state_dict", list(flatten(state_dict)), version)

    def get_state_dict(self, key: str, user_state_dict: dict | None = None, *, version: int | None = None,
                       timeout: timedelta | None = None, strict: bool = True) -> dict:
        """The state dict stored under `key`. With `user_state_dict`, its tensors are filled in
        place (a DTensor receives its own shard, resharded from however the writers held it)
        and it is returned with its other leaves replaced; `strict` refuses names that only
        one side has, as load_state_dict does. Its tensors are filled as load_state_dict fills
        a module's (parameters too, whatever the grad mode), each one's version bumped."""
        self._check_key(key)
        if user_state_dict is not None and not isinstance(user_state_dict, dict):
            raise TypeError(self._message(f"get_state_dict('{key}'): user_state_dict is a (nested) dict of "
                                          f"tensors to fill (or None), got {type(user_state_dict).__name__}"))
        with calling_as("get_state_dict"):  # the read's messages name this verb
            return self._read(key, version, timeout,
                              lambda v, parts: self._state_dict_plan(key, v, parts, user_state_dict, strict),
                              fills=user_state_dict is not None)

    def put_batch(self, items: dict[str, Any], *, version: int | None = None) -> dict[str, int]:
        """put() of every key of `items`; returns each key's version."""
        return {key: self.put(key, value, version=version) for key, value in items.items()}

    def get_batch(self, keys: Iterable[str] | dict[str, torch.Tensor | None], *,
                  version: int | None = None) -> dict[str, Any]:
        """get() of every key (a dict maps keys to their in-place tensors)."""
        targets = keys if isinstance(keys, dict) else {key: None for key in keys}
        return {key: self.get(key, inplace, version=version) for key, inplace in targets.items()}

    def broadcast_state_dict(self, state_dict: dict, key: str, *, src: int = 0, group: Any = None,
                             version: int | None = None) -> int:
        """Broadcast mode: every member of `group` (a process group; default: the default
        one) calls this at once, and the state dict of global rank `src` is delivered into
        every other member's state dict in place (tensors with the same names, dtypes, shapes
        and device types; other leaves are replaced by the writer's), in pipelined buckets of
        `bucket_bytes` over the group's broadcast. Serves many readers with one send per
        link where gets fetch a copy each. Returns the version: the writer's next of `key`
        (or `version`), which every member learns."""
        # A bad argument on one member is every member's error (raised on each, naming that
        # rank): raised here alone, the others would wait in the broadcasts for the timeout.
        what = self._message(f"broadcast_state_dict({key!r})")
        problem = None
        try:
            self._check_key(key)
        except ValueError as error:
            problem = str(error)
        if problem is None and not isinstance(state_dict, dict):
            problem = f"needs a dict, got {type(state_dict).__name__}"
        with self._broadcasting:  # a collective: it waits for the group, never under self._lock
            return self._broadcaster.run(state_dict, key, src, group, version, what, problem)

    def make_lendable(self, target: Any) -> None:
        """Moves the tensors of `target` (a module's parameters and buffers, or a state dict's
        tensors) into memory this store can lend, one buffer per device. Each keeps its value,
        its identity and requires_grad, so the module and its optimizer go on as before. Call
        it once, before lending and before taking views or state dicts of those tensors."""
        what = self._message("make_lendable")
        with self._lock:
            if self._closed:  # its buffers would be made for a store that lends nothing more
                raise RuntimeError(f"{what}: this TensorStore is closed")
            moving = [tensor for _, tensor in lendable_tensors(target, what, self._lends)]
            with touching_callers_tensors():  # a cancel stops it before the move, or waits for all of it
                self._lendable += move_to_new_buffers(
                    moving, lambda device, size: self._buffer("make_lendable", device, size, []))

    def lend_state_dict(self, state_dict: dict, key: str, *, version: int | None = None) -> int:
        """Publishes a state dict as a new version of `key` without copying it: readers copy
        straight out of the writer's tensors, which make_lendable must have moved into this
        store's memory. One version is out at a time, readable until reclaim(key); change the
        tensors only between reclaim and the next lend (or inside `with updating(key):`)."""
        if not isinstance(state_dict, dict):
            raise TypeError(self._message(f"lend_state_dict('{key}') needs a dict, got {type(state_dict).__name__}"))
        with calling_as("lend_state_dict"):
            return self._lend_leaves(key, "state_dict", list(flatten(state_dict)), version)

    def lend(self, key: str, value: torch.Tensor, *, version: int | None = None) -> int:
        """lend_state_dict for a single tensor."""
        with calling_as("lend"):
            return self._lend_leaves(key, "tensor", [((), value)], version)

    def reclaim(self, key: str) -> None:
        """Takes the lent version of `key` back before its tensors change: a reader copying
        it now finds it changed and does not keep the copy; readers of the latest wait for
        the next lend (up to their timeout), readers of that version are told it is gone."""
        self._check_key(key)
        with self._lock:
            lent = self._lent.get(key)
            if lent is None:
                raise KeyError(self._message(f"reclaim('{key}'): this rank lends no such key"))
            take_back(lent.plan.buffers)

    @contextlib.contextmanager
    def updating(self, key: str):
        """`with ts.updating(key): optimizer.step()`: reclaims the lent version of `key`, and
        lends its tensors again as the next version once the block ends without an error
        (after an error they stay reclaimed: half-updated tensors are never lent)."""
        self.reclaim(key)
        yield
        lent = self._lent[key]
        with calling_as("lend_state_dict" if lent.kind == "state_dict" else "lend"):  # as first lent
            self._lend_leaves(key, lent.kind, lent.leaves, None)

    def delete(self, key: str) -> None:
        """Removes `key`: readers find it no more, and this process frees its buffers for it."""
        self._check_key(key)
        with self._lock:
            latest = self._latest(key)
            if latest is None and key not in self._owned and key not in self._lent:
                raise KeyError(self._message(f"delete('{key}'): no such key"))
            if latest is not None:
                self._raise_floor(key, latest[0])
            self._forget(key)
            for kept in self._owned.pop(key, ()):
                self._unpublish(key, kept)
            self._forget_abandoned(key, latest[0] + 1 if latest else 1 << 62)
            lent = self._lent.pop(key, None)
            if lent is not None:
                self._withdraw(key, lent)
            # Kept: the next put is numbered from this rank's last version, as every other
            # writer of the key (a DTensor's mesh) numbers its own, whoever deleted it.
            self._latest_seen.pop(key, None)
            self._write_plans.pop(key, None)
            self._read_plans.pop(key, None)
            self._mappings.forget_key(key)

    def exists(self, key: str) -> bool:
        """True if some version of `key` is readable."""
        self._check_key(key)
        return self._latest(key) is not None

    def keys(self, prefix: str | None = None) -> list[str]:
        """The readable keys (those starting with `prefix`), sorted."""
        if prefix is not None and not isinstance(prefix, str):
            raise TypeError(self._message(f"keys(prefix=...): prefix is a str (or None), got {type(prefix).__name__}"))
        index = self._get_now("index")
        if index is None:
            return []
        names = {name for name in index.decode().split("\n") if name}
        return sorted(n for n in names if (prefix is None or n.startswith(prefix)) and self.exists(n))

    def latest_version(self, key: str) -> int | None:
        """The newest complete version of `key`, or None if there is none."""
        self._check_key(key)
        latest = self._latest(key)
        return latest[0] if latest else None

    def close(self) -> None:
        """Frees this process's buffers. Versions it put stay listed; readers that have not
        copied them get an error naming this rank. Keys it lends are withdrawn (the tensors
        stay the caller's, unguarded from now on)."""
        with self._lock:
            for key, lent in self._lent.items():  # nobody guards them any more
                self._withdraw(key, lent)
            self._lent.clear()
            self._lendable.clear()
            self._owned.clear()
            self._write_plans.clear()
            self._read_plans.clear()
            self._mappings.clear()
            self._broadcaster.plans.clear()  # their bucket buffers (GPU memory for CUDA tensors)
            self._closed = True

    def __enter__(self) -> "TensorStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- writing --------------------------------------------------------------------------

    def _put_leaves(self, key: str, kind: str, leaves: list[tuple[tuple, Any]], version: int | None) -> int:
        self._check_key(key)
        writers, index = self._writers(key, leaves)
        plan = self._write_plan(key, kind, index, leaves)
        with torch.no_grad():
            sources = plan.sources(leaves)
        with self._lock:
            if self._closed:
                raise RuntimeError(self._message(f"{asked(key)}: this TensorStore is closed"))
            if key in self._lent:
                raise ValueError(self._message(f"{asked(key)}: this rank lends that key; a key is either "
                                               f"put or lent (delete it first, or use another key)"))
            version = self._next_version(key, version)
            return self._publish(key, kind, version, index, writers, plan, sources)

    def _write_plan(self, key: str, kind: str, index: int, leaves: list[tuple[tuple, Any]]) -> "WritePlan":
        """Where each leaf goes in this writer's buffers. Made once for a state dict whose
        tensors are the same objects put after put (a model's parameters), and again when one
        of them changed in place (a new dtype, shape or memory); objects are pickled anew each
        time, so a state dict holding any is planned every put. The names are part of what
        is planned: the same tensors under other names (renamed, or swapped) are a new plan."""
        identity = (kind, index, tuple((path, id(v)) for path, v in leaves))
        plan = self._write_plans.get(key)
        if plan is not None and plan.identity == identity and plan.alive(leaves):
            return plan
        pieces: list[tuple[TensorMeta, int, Any]] = []  # (meta, leaf index, stored value)
        for i, (path, value) in enumerate(leaves):
            if isinstance(value, torch.Tensor):  # refused here, before the put changes anything
                problem = unstorable(value)
                if problem is not None:
                    raise ValueError(self._message(f"{asked(key)}: {self._name(path)} {problem}"))
            if is_dtensor(value):
                box, global_shape = self._dtensor_box(value, self._what(key, path))
                if is_first_replica(value):
                    pieces.append((TensorMeta(path, value.dtype, box, global_shape, 0, 0), i, None))
            elif index != 0:
                continue  # plain tensors and objects are stored once, by the first writer
            elif isinstance(value, torch.Tensor):
                pieces.append((TensorMeta(path, value.dtype, whole(value.shape), tuple(value.shape), 0, 0), i, None))
            else:
                data = pickled_tensor(value, self._message(f"{asked(key)}: {self._name(path)}"))
                pieces.append((TensorMeta(path, torch.uint8, whole(data.shape), tuple(data.shape), 0, 0, pickled=True), i, data))
        plan = WritePlan(identity, leaves, pieces)
        if plan.cacheable:
            self._write_plans[key] = plan
        return plan

    def _writers(self, key: str, leaves: list[tuple[tuple, Any]]) -> tuple[list[int], int]:
        """The ranks that put this version together (a DTensor's mesh), and this rank's place."""
        meshes = [value.device_mesh for _, value in leaves if is_dtensor(value)]
        if not meshes:
            return [self._rank], 0
        writers = meshes[0].mesh.flatten().tolist()
        for mesh in meshes[1:]:
            if mesh is not meshes[0] and sorted(mesh.mesh.flatten().tolist()) != sorted(writers):
                raise ValueError(self._message(
                    f"{asked(key)}: its DTensors live on meshes of different ranks "
                    f"({sorted(writers)} and {sorted(mesh.mesh.flatten().tolist())}); one key is "
                    f"put by one set of ranks: split it into one key per mesh"))
        me = dist.get_rank()  # the mesh names global ranks, whatever label this store was given
        if me not in writers:
            raise ValueError(self._message(f"{asked(key)}: global rank {me} is not in its DTensors' mesh {writers}"))
        return writers, writers.index(me)

    def _take_version(self, key: str, version: int, writers: list[int], verb: str) -> None:
        """Takes version number `version` of `key` for `writers` (this store alone, or a
        DTensor's mesh, which put one version together), or refuses it: a key's versions are
        one sequence, and two writers that numbered a put alike would each publish one, and
        readers would lose one of the pair. Another writer may go on with a key (it numbers
        from the latest)."""
        mine = self._writer_record(writers)
        owner = self._store.compare_set(f"k/{key}/v{version}/writers", b"", mine)
        if owner != mine:
            latest = self._latest(key)
            raise ValueError(self._message(
                f"{verb}('{key}'): version {version} of that key was put by {self._writer_text(owner)}; a "
                f"key's versions are one sequence, each put once (the latest is "
                f"{latest[0] if latest else 'not complete yet'}): pass version= above it, or put a key "
                f"per writer"))
        # Free, but only because another writer went past it and retired it since: readers of
        # the latest would never see it.
        latest = self._latest(key)
        if latest is not None and latest[0] >= version:
            self._store.delete_key(f"k/{key}/v{version}/writers")
            raise ValueError(self._message(
                f"{verb}('{key}'): version {version} is not above the latest, {latest[0]}: another "
                f"writer went on with the key since this one's last {verb} (the versions between are "
                f"no longer kept); pass version= above it, or put a key per writer"))

    def _writer_record(self, writers: list[int]) -> bytes:
        """What k/<key>/v<V>/writers holds for a version `writers` put: a DTensor's mesh by its
        ranks (each rank of it writes the same record), one writer by its rank, pid, host and
        TensorStore. Ranks alone would not do: without a process group every store is rank 0
        unless told otherwise, and two processes would each take the same number."""
        if len(writers) > 1:
            return ",".join(map(str, sorted(writers))).encode()
        return f"{writers[0]}|{os.getpid()}@{self._host}#{self._serial}".encode()

    def _writer_text(self, record: bytes) -> str:
        """Who a writers record names, for messages."""
        ranks, _, writer = record.decode(errors="replace").partition("|")
        if not writer:
            return f"rank(s) {ranks}"
        pid, _, rest = writer.partition("@")
        host = rest.rpartition("#")[0]
        if host != self._host:
            return f"rank(s) {ranks} (pid {pid} on another host)"
        if pid == str(os.getpid()):
            return f"rank(s) {ranks} (another TensorStore of this process)"
        return f"rank(s) {ranks} (pid {pid})"

    def _next_version(self, key: str, version: int | None) -> int:
        last = self._last_version.get(key)
        if last is None:  # this writer's first version of the key (or its first puts failed)
            # From the latest, or, for a key deleted, from the last version it had: the
            # writers of those may still hold their numbers.
            latest = self._latest(key)
            floor = self._get_now(f"k/{key}/floor")
            last = max(latest[0] if latest else 0, int(floor) if floor else 0)
        if version is None:
            return last + 1
        if not is_version_number(version):
            raise ValueError(self._message(
                f"{asked(key, version)}: versions are Python ints (got "
                f"{type(version).__name__}; int(...) converts a numpy integer)"))
        if version <= (last or 0):
            raise ValueError(self._message(
                f"{asked(key, version)}: versions must be integers that grow; the last "
                f"version of this key is {last}"))
        return version

    def _publish(self, key: str, kind: str, version: int, index: int, writers: list[int], plan: "WritePlan",
                 sources: list[torch.Tensor]) -> int:
        parts = len(writers)
        kept = self._owned.get(key, collections.deque())  # this rank owns the key once it keeps a version
        # The versions that make room, chosen first: a mesh rank too far ahead of its peers is
        # refused before it takes a number. Its peers will put this number (their parts of
        # the same step), and number their next put after it: so does this rank, its part
        # abandoned (or that put would complete this number with their parts of the step
        # before, and every later version would mix two steps).
        try:
            retiring = self._retiring(key, kept, writers)
        except TensorStoreError:
            self._last_version[key] = version
            self._abandon(key, version)
            raise
        # Then the number, before an old version is retired: a refused number changes nothing.
        self._take_version(key, version, writers, called_verb())
        # The oldest versions go to make room, and their buffers may be reused; but only once
        # this put has its buffers: a put refused for memory or its device keeps them all.
        try:
            spare = [buffer for old in retiring for buffer in old.buffers]
            buffers = [self._buffer(asked(key), device, capacity, spare)
                       for device, capacity in zip(plan.devices, plan.capacity)]
        except BaseException:
            if parts == 1:  # nothing of it was published: its number is free again
                self._store.delete_key(f"k/{key}/v{version}/writers")
            else:
                # The mesh's other ranks publish their parts of this number and number their
                # next put after it: so must this rank, or that put would complete this
                # number with their parts of the step before. Nor may they wait for it.
                self._last_version[key] = version
                self._abandon(key, version)
            raise
        for old in retiring:
            kept.remove(old)
            self._unpublish(key, old)
        del spare, retiring  # buffers not reused are freed here
        self._announce(key)
        regions = tuple(b.region.id for b in buffers)
        layout = plan.layouts.get(regions)
        if layout is None:
            part = PartMeta(key=key, version=0, index=index, parts=parts, rank=self._rank, host=self._host,
                            kind=kind, buffers=[b.meta() for b in buffers], tensors=plan.metas,
                            **_served(buffers))
            if len(plan.layouts) > self._keep:
                plan.layouts.clear()
            layout = plan.layouts[regions] = part.layout()
        base = f"k/{key}/v{version}"
        # The part goes out before the bytes: a reader waiting for this version copies each
        # bucket as it lands. Readers of the latest see the version only once it is complete.
        generations = tuple(buffer.next_generation() for buffer in buffers)
        # The mode goes with every part, in the same round trip: a key deleted by a rank that
        # did not put it is back in full with the next put (this writer cannot tell it was gone).
        self._store.multi_set([f"{base}/p{index}", f"k/{key}/mode"], [encode_part(layout, generations), b"put"])
        kept.append(Kept(version, index, parts, buffers))
        self._owned[key] = kept
        self._last_version[key] = version
        try:
            with touching_callers_tensors(), torch.no_grad():  # a cancel waits for the copies
                for buffer, on_device in zip(buffers, plan.pieces_on):
                    buffer.write([(sources[i], plan.metas[i].offset) for i in on_device], self._bucket_bytes)
        except BaseException:
            self._store.delete_key(f"{base}/p{index}")  # never complete: readers of it are told
            if parts == 1:  # its number stays skipped; nobody else's part needs the record
                self._store.delete_key(f"{base}/writers")
            else:
                self._abandon(key, version)
            # Nor kept: it must not take one of the `keep` places, or the next put would
            # retire the latest readable version to make room.
            kept.pop()
            raise
        if parts == 1:
            self._store.set(f"{base}/complete", b"1")
            self._advance_latest(key, version, parts)
        else:
            if self._store.add(f"{base}/done", 1) == parts:
                self._store.set(f"{base}/complete", str(parts))
                self._advance_latest(key, version, parts)
        return version

    def _buffer(self, what: str, device: torch.device, capacity: int, spare: list[OwnedBuffer]) -> OwnedBuffer:
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
                    f"{what} needs {capacity} bytes of shared memory and this host has "
                    f"{available} available: put less, or free memory (each key keeps "
                    f"{self._keep} versions)"))
        buffer = OwnedBuffer(device, capacity)
        if self._serve_remote:
            buffer.server, buffer.unserved = serve(self._job_store, buffer)
        return buffer

    def _lend_leaves(self, key: str, kind: str, leaves: list[tuple[tuple, Any]], version: int | None) -> int:
        self._check_key(key)
        what = self._message(asked(key))
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{what}: this TensorStore is closed")
            if key in self._owned:
                raise ValueError(f"{what}: this rank put that key; a key is either put or lent "
                                 f"(delete it first, or use another key)")
            lent = self._lent.get(key)
            plan = lent.plan if lent is not None else None
            if plan is None or plan.signature != leaf_signature(leaves):
                plan = lent_metas(leaves, self._lendable, what)
            for other, lent_there in self._lent.items():
                if other != key and any(b in lent_there.plan.buffers for b in plan.buffers):
                    raise ValueError(f"{what}: its tensors share a buffer with key '{other}', lent by "
                                     f"this rank; a buffer is lent under one key (make_lendable each "
                                     f"model separately)")
            version = self._next_version(key, version)
            self._take_version(key, version, [self._rank], called_verb())
            self._announce(key)
            for device in {b.device for b in plan.buffers if b.device.type == "cuda"}:
                torch.cuda.synchronize(device)  # the writer's queued updates land before readers copy
            take_back(plan.buffers)  # lent again without a reclaim: readers of the last one retry
            generations = tuple(buffer.region.end_write() for buffer in plan.buffers)
            if not plan.layout:
                plan.layout = PartMeta(key=key, version=0, index=0, parts=1, rank=self._rank, host=self._host,
                                       kind=kind, buffers=[b.meta() for b in plan.buffers], tensors=plan.metas,
                                       lent=True, **_served(plan.buffers)).layout()
            # One round trip: the lent part travels inside `latest` (one writer lends a key, and
            # keeps one version), so a reader of the latest has it in one round trip too; the
            # mode goes with it every time (see _publish).
            self._store.multi_set([f"k/{key}/latest", f"k/{key}/mode"],
                                  [f"{version}/1/".encode() + encode_part(plan.layout, generations), b"lent"])
            if lent is not None:  # the version lent before is gone: so is its number's record
                self._store.delete_key(f"k/{key}/v{self._last_version[key]}/writers")
            if lent is not None and lent.plan is not plan:  # other tensors now: the old ones are not guarded
                take_back([b for b in lent.plan.buffers if b not in plan.buffers])
            self._lent[key] = Lent(kind, leaves, plan)
            self._last_version[key] = version
            return version

    def _announce(self, key: str) -> None:
        """Once per key and writer: lists it for keys() (the index is never trimmed: keys()
        asks whether each is readable)."""
        if key not in self._indexed:
            self._store.append("index", key + "\n")
            self._indexed.add(key)

    def _withdraw(self, key: str, lent: Lent) -> None:
        """Ends lending `key`: its buffers stay the writer's tensors' memory, marked as being
        changed, and the key is gone (one writer lends a key: its version is the latest)."""
        take_back(lent.plan.buffers)
        self._store.delete_key(f"k/{key}/v{self._last_version[key]}/writers")
        self._forget(key)

    def _forget(self, key: str) -> None:
        """Removes what says `key` exists: readers find no such key, and its next put starts
        its versions anew. It stays in the index (keys() asks whether each listed key is
        readable), so a key put again is not listed again: a loop that puts and deletes one
        key would grow the index, and each keys(), without bound."""
        # The mode first: a reader that finds no latest then finds no mode either, never a key
        # that says it is lent with nothing lent (which it would ask about again and again).
        self._store.delete_key(f"k/{key}/mode")
        self._store.delete_key(f"k/{key}/latest")

    def _raise_floor(self, key: str, version: int) -> None:
        """Notes that `key` had versions up to `version` when it was deleted: a writer without
        versions of its own numbers its first put past them (their writers may keep them,
        and their numbers, after another rank deleted the key)."""
        name = f"k/{key}/floor"
        seen = self._get_now(name) or b""
        while int(seen or 0) < version:
            seen = self._store.compare_set(name, seen, str(version).encode())

    def _lends(self, tensor: torch.Tensor) -> bool:
        """True if `tensor` already lives in one of this store's lendable buffers."""
        return home_of(tensor, self._lendable) is not None

    def _advance_latest(self, key: str, version: int, parts: int) -> None:
        """Sets latest to `version` unless a newer one is there (compare-and-set: it only grows)."""
        name = f"k/{key}/latest"
        value = f"{version}/{parts}".encode()
        expected = self._latest_seen.get(key, b"")
        while True:
            seen = self._store.compare_set(name, expected, value)
            if seen == value:
                break
            if seen == expected:  # the Store answers so when the key is missing
                expected = b""
                continue
            if int(seen.split(b"/", 1)[0]) >= version:
                break
            expected = seen
        self._latest_seen[key] = value

    # ---- reading --------------------------------------------------------------------------

    def _get_now(self, name: str) -> bytes | None:
        """The value of `name`, or None if it is missing, in one round trip. (Store.get waits
        for a missing key until the Store's timeout, and check-then-get can lose a key that is
        deleted in between.) A compare-and-set whose expected value no key holds changes
        nothing and answers the value, or, for a missing key, the expected value itself."""
        value = self._store.compare_set(name, _ABSENT, _ABSENT)
        return None if value == _ABSENT else value

    def _latest(self, key: str) -> tuple[int, int, bytes | None] | None:
        """(version, parts, the part itself for a lent key) of the newest complete version, or None."""
        value = self._get_now(f"k/{key}/latest")
        if value is None:
            return None
        fields = value.split(b"/", 2)
        return int(fields[0]), int(fields[1]), fields[2] if len(fields) > 2 else None

    def _read(self, key: str, version: int | None, timeout: timedelta | None, plan_for, fills: bool = False) -> Any:
        """Reads a complete version: plan_for(version, parts) says what to copy where, and
        the plan runs until it reads a version that was not rewritten meanwhile. Waits (for
        the version, for its bytes) are made outside the store's lock. `fills`: the plans copy
        into the caller's tensors, which a read that fails after a try may leave part-written
        (its error then says so)."""
        tried = False  # a plan ran, and its version was replaced or released meanwhile
        try:
            timeout = as_timeout(timeout, f"loom tensor store {asked(key)}")
            if version is not None and not is_version_number(version):
                raise ValueError(self._message(
                    f"{asked(key, version)}: versions are Python ints (got "
                    f"{type(version).__name__}; int(...) converts a numpy integer)"))
            if version is not None and version < 1:
                raise ValueError(self._message(
                    f"{asked(key, version)}: versions are integers from 1 (None reads the latest)"))
            wait = timeout if timeout is not None else self._timeout
            deadline = time.monotonic() + wait.total_seconds()
            retries = 0
            while retries < self._RETRIES:
                v, parts = self._parts(key, version, timeout, by=deadline)
                try:
                    return self._run_plan(plan_for, v, parts, wait, deadline)
                except Released as released:
                    # Released while planning (mapping a buffer) copied nothing yet.
                    tried = tried or getattr(released, "while_copying", False)
                    # A put that retired the version just looked up frees its buffer unless it
                    # reuses it: that read of the latest is retried on the newer version. With no
                    # newer one the writer closed or exited, and the error says so.
                    latest = self._latest(key)
                    if version is not None or latest is None or latest[0] <= v:
                        raise
                    retries += 1
                except Stale as stale:
                    tried = tried or stale.copied
                    if version is not None and parts[0].lent:
                        raise TensorStoreError(self._message(
                            f"{asked(key, version)}: rank {parts[0].rank} reclaimed that lent "
                            f"version to change its tensors; ask for the latest")) from None
                    if version is not None:
                        raise TensorStoreError(self._message(
                            f"{asked(key, version)}: the writer replaced that version while "
                            f"it was read (it keeps {self._keep}), or gave it up (its put failed "
                            f"midway); read it sooner, or ask for the latest")) from None
                    if parts[0].lent:  # the writer is changing its tensors: wait for the next lend
                        if time.monotonic() > deadline:  # each lend reclaimed before it was copied
                            raise TimeoutError(self._message(
                                f"{asked(key)}: rank {parts[0].rank} reclaimed each lent version before "
                                f"this rank could copy it, for {wait}; lend less often, or read with "
                                f"{called_verb()}'s timeout larger"))
                        self._await_latest(key, parts[0].version, deadline,
                                           f"{asked(key)}: rank {parts[0].rank} reclaimed version {parts[0].version} "
                                           f"and did not lend the next within {wait} (or reclaims each version "
                                           f"before this rank can copy it)", parts[0])
                    else:
                        retries += 1
            raise TensorStoreError(self._message(
                f"{asked(key)}: {self._RETRIES} newer versions were put while reading the latest; "
                f"the writer puts faster than this rank can read"))
        except (TensorStoreError, TimeoutError) as error:
            if not (fills and (tried or getattr(error, "while_copying", False))):
                raise
            # The copies go straight into the caller's tensors and are checked after (staging
            # them would double the memory and the copying of every refresh): a version
            # replaced or reclaimed meanwhile, or one whose writer died or stalled as it was
            # read, leaves them mixed, and the caller must know.
            raise type(error)(f"{error}; the tensors this {called_verb()} was filling may hold part of a "
                              f"version it could not read whole: get them again before using "
                              f"them") from error

    def _run_plan(self, plan_for, version: int, parts: list[PartMeta], wait: timedelta, deadline: float) -> Any:
        """Plans under the lock (plans, layouts and mappings are the store's, shared by its
        threads), then runs the plan outside it: its copies may wait for a writer's bytes, until
        the read's `deadline` (its `wait` from when it began). A plan is run by one read at a
        time (a cached plan in use is not handed out again)."""
        with self._lock:
            plan = plan_for(version, parts)
            plan.wait_limit = wait
            plan.deadline = deadline
            plan.in_use = True
        try:
            stop_if_cancelled()  # the last point before copies into the caller's tensors begin
            return plan.run(parts)
        except Released as released:
            if not hasattr(released, "while_copying"):  # said where it is known
                released.while_copying = True  # the caller's tensors may hold part of it
            raise
        finally:
            plan.in_use = False

    def _parts(self, key: str, version: int | None, timeout: timedelta | None, retries: int = 8,
               by: float | None = None) -> tuple[int, list[PartMeta]]:
        """The version to read and its parts, waiting for a version not complete yet until `by`
        (a monotonic time: the read's deadline) or, without one, for `timeout`."""
        named = version  # None: the latest, whichever it is by the time it is read
        latest = self._latest(key)
        if version is None:
            if latest is None:
                raise KeyError(self._message(f"{asked(key)}: no such key (put it first; keys() lists the readable ones)"))
            version, parts, lent = latest
        elif latest is not None and version == latest[0]:
            parts, lent = latest[1], latest[2]
        elif latest is not None and latest[2] is not None and version > latest[0]:
            self._await_lent(key, version, latest[0], timeout, self._decode(latest[2], latest[0]))
            return self._parts(key, version, timeout, retries, by)
        else:
            lent = None
            complete = self._get_now(f"k/{key}/v{version}/complete")  # one look: it may be retired
            if complete is not None:
                parts = int(complete)
            elif latest is not None and latest[2] is not None and version < latest[0]:
                # A lent key keeps its latest version only (no version of it is ever marked
                # complete): an older one was reclaimed when the next was lent.
                raise TensorStoreError(self._message(
                    f"{asked(key, version)}: that lent version was reclaimed when a newer "
                    f"one was lent (a lent key keeps only its latest); the latest is {latest[0]}: "
                    f"ask for it"))
            elif latest is not None and version <= latest[0]:
                # Within the last `keep` a version missing was never completed; further back
                # it may have been, and retired since.
                why = ("was never completed (the writers skipped it, or its put failed)"
                       if version > latest[0] - self._keep else
                       f"is no longer kept, or was never completed (writers keep their last {self._keep})")
                raise TensorStoreError(self._message(
                    f"{asked(key, version)}: that version {why}; the latest is {latest[0]}"))
            else:  # not complete yet: wait for its parts; their bytes are read as written
                first = f"k/{key}/v{version}/p0"
                wait = timeout if timeout is not None else self._timeout
                if by is None:  # one deadline for the waits below
                    by = time.monotonic() + wait.total_seconds()
                if latest is None:  # nothing out yet: is the key put or lent?
                    mode = f"k/{key}/mode"
                    self._wait(key, version, [mode], wait, by)
                    if self._get_now(mode) == b"lent":
                        self._await_lent(key, version, None, timeout)
                        if retries == 0:  # lent, by its mode, yet never a latest
                            raise TensorStoreError(self._message(
                                f"{asked(key, version)}: the key says it is lent but no "
                                f"version of it is (a rank that deleted it stopped half way?); lend "
                                f"or put it again"))
                        time.sleep(0.01)
                        return self._parts(key, version, timeout, retries - 1, by)
                self._wait(key, version, [first], wait, by)
                value = self._get_now(first)
                if value is None:  # withdrawn: its put failed
                    raise TensorStoreError(self._message(
                        f"{asked(key, version)}: the writer gave that version up (its put failed)"))
                parts = self._decode(value, version).parts
                self._wait(key, version, [f"k/{key}/v{version}/p{i}" for i in range(parts)], wait, by)
        if lent is not None:
            return version, [self._decode(lent, version)]
        # One look each (a check, then a get, would wait the Store's timeout for a part retired
        # in between).
        values = [self._get_now(f"k/{key}/v{version}/p{i}") for i in range(parts)]
        if any(value is None for value in values):  # retired since latest was read
            # The latest is asked again; a version the caller named is gone, and no newer one
            # may stand in for it.
            if retries == 0 or named is not None:
                raise TensorStoreError(self._message(f"{asked(key, version)}: that version is no longer kept"))
            return self._parts(key, None, timeout, retries - 1, by)
        return version, [self._decode(value, version) for value in values]

    def _decode(self, value: bytes, version: int) -> PartMeta:
        """The part a Store value describes, its layout decoded once per layout bytes."""
        generations, layout = split_part(value)
        with self._lock:  # one template per layout: plans are cached by its tensor list's id
            template = self._layouts.get(layout)
            if template is None:
                if len(self._layouts) > 256:
                    self._layouts.clear()
                template = self._layouts[layout] = pickle.loads(layout)
        return replace(template, version=version, generations=generations)

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


def _served(buffers: list[OwnedBuffer]) -> dict:
    """The PartMeta fields that tell readers on other hosts where to fetch these buffers."""
    if not buffers:
        return {}
    return {"server": buffers[0].server, "unserved": buffers[0].unserved}


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
