"""What one writer publishes for one version of a key (a part), and the buffers behind it.

A writer packs everything it stores for a version into one buffer per device: a shared-memory
region for CPU tensors, device memory for CUDA tensors (exported with CUDA IPC). Its part,
a small pickled record in the job's Store, says where each tensor sits in those buffers and
which generation of each buffer holds this version. Readers map or open the buffers once and
copy straight out of them; no bytes pass through the Store or any server.
"""

from __future__ import annotations

import math
import os
import pickle
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import _C
from ._layout import Box

# Every tensor starts at a multiple of this many bytes (any dtype's alignment, a cache line).
_ALIGN = 64


@dataclass
class TensorMeta:
    """One stored tensor (or one shard of one), as a reader finds it."""

    path: tuple  # where it sits in a state dict; () for a single value
    dtype: torch.dtype
    box: Box  # the block of the global tensor stored here
    global_shape: tuple[int, ...]
    buffer: int  # index into PartMeta.buffers
    offset: int  # bytes into that buffer
    pickled: bool = False  # uint8 bytes of a pickled object, not a tensor

    @property
    def nbytes(self) -> int:
        return self.box.numel * self.dtype.itemsize


@dataclass
class BufferMeta:
    """Where a reader finds one buffer, and the generation its bytes must have."""

    device: str  # "cpu" or "cuda"
    pid: int
    fd: int
    region_id: str
    capacity: int  # bytes
    cuda_ipc: tuple | None = None  # torch's rebuild function and arguments, for device memory
    started: int = 0  # when process `pid` started (process_start): tells it from a later one

    def owner_alive(self) -> bool:
        """Whether the process that owns this buffer still runs (asked on its host)."""
        now = process_start(self.pid)
        return now is not None and (self.started == 0 or now == self.started)


@dataclass
class PartMeta:
    """Everything one writer stored for one version of one key."""

    key: str
    version: int
    index: int  # which writer of the version (0 .. parts - 1)
    parts: int
    rank: int
    host: str
    kind: str  # "tensor", "object" or "state_dict"
    buffers: list[BufferMeta] = field(default_factory=list)
    tensors: list[TensorMeta] = field(default_factory=list)
    generations: tuple[int, ...] = ()  # per buffer: the generation holding this version
    lent: bool = False  # the writer's own tensors (lend_state_dict): readable until reclaimed
    server: tuple[str, int] | None = None  # where readers on other hosts fetch the buffers
    unserved: str = ""  # why they cannot, if server is None

    def layout(self) -> bytes:
        """Everything but the version and the generations, which change every put: a writer
        that repeats its layout publishes the same bytes, and readers decode them once."""
        return pickle.dumps(replace(self, version=0, generations=()), protocol=pickle.HIGHEST_PROTOCOL)


def encode_part(layout: bytes, generations: tuple[int, ...]) -> bytes:
    """The Store value of a part: its buffers' generations, then its layout."""
    return ",".join(map(str, generations)).encode() + b"|" + layout


def split_part(value: bytes) -> tuple[tuple[int, ...], bytes]:
    """(generations, layout) of a Store value written by encode_part."""
    head, _, layout = value.partition(b"|")
    return tuple(int(g) for g in head.split(b",")) if head else (), layout


def host_identity() -> str:
    """Processes that can read each other's regions share this: loom's host (a kernel and a
    network namespace) and a pid namespace (so /proc/<pid> names the owner)."""
    return _C.host_identity()


def process_start(pid: int) -> int | None:
    """When process `pid` of this pid namespace started (clock ticks after boot, the 22nd
    field of /proc/<pid>/stat), or None if it has exited. A process that exited and waits for
    its parent to reap it (a zombie) has exited too: it will write nothing more, though its
    /proc entry stays; and a later process given the same pid starts at another time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()  # from the 3rd field, the state, on
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


_own_start = (0, 0)  # (pid, process_start(pid)) of this process, once asked


def own_start() -> int:
    """process_start of this process (read once per pid: a forked child reads its own)."""
    global _own_start
    pid = os.getpid()
    if _own_start[0] != pid:
        _own_start = (pid, process_start(pid) or 0)
    return _own_start[1]


def aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def typed_view(data: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes [offset, offset + size) of uint8 tensor `data` seen as a tensor of `shape`."""
    nbytes = math.prod(shape) * dtype.itemsize
    return data.narrow(0, offset, nbytes).view(dtype).view(shape)


class OwnedBuffer:
    """A writer's buffer on one device: written once per version it carries."""

    def __init__(self, device: torch.device, capacity: int):
        self.device = device
        if device.type == "cpu":
            self.region = _C.Region.create(capacity)
            self.data = self.region.tensor()
            self._ipc = None
        elif device.type == "cuda":
            # The bytes live in device memory; the region is a header alone, carrying the
            # generation that readers check.
            self.region = _C.Region.create(0)
            self.data = torch.empty(capacity, dtype=torch.uint8, device=device)
            from torch.multiprocessing.reductions import reduce_tensor

            self._ipc = reduce_tensor(self.data)
        else:
            raise ValueError(f"loom tensor store: tensors on {device} cannot be stored (CPU and CUDA can)")
        self.capacity = capacity
        self.base = self.data.data_ptr()
        self._views: dict[tuple, torch.Tensor] = {}
        self.server: tuple[str, int] | None = None  # serving readers on other hosts (_remote.serve)
        self.unserved = "the writer does not serve readers on other hosts (serve_remote=False)"

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The bytes at `offset` as a tensor (made once per layout: versions repeat theirs)."""
        return cached_view(self._views, self.data, offset, dtype, shape)

    def next_generation(self) -> int:
        """The generation the next write() will leave (published before it starts)."""
        return (self.region.generation() | 1) + 1

    def write(self, pieces: list[tuple[torch.Tensor, int]], bucket_bytes: int) -> int:
        """Copies each (tensor, offset) in, in order of offset, a bucket of about
        `bucket_bytes` at a time, publishing its progress after each so that readers can
        copy a bucket while the next is written. Returns the generation that holds them."""
        views = [self.view(offset, tensor.dtype, tuple(tensor.shape)) for tensor, offset in pieces]
        srcs = [tensor for tensor, _ in pieces]
        self.region.begin_write()
        try:
            start = 0
            while start < len(pieces):
                end, size = start, 0
                while end < len(pieces) and (end == start or size < bucket_bytes):
                    size += views[end].numel() * views[end].element_size()
                    end += 1
                run_copies(copy_groups(views[start:end], srcs[start:end]), self.capacity)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                last = views[end - 1]
                self.region.set_progress(pieces[end - 1][1] + last.numel() * last.element_size())
                start = end
        except BaseException:
            # The generation must never reach the published one with half-written bytes: it
            # skips it, so readers of this version see it replaced.
            self.region.abandon_write()
            raise
        return self.region.end_write()

    def meta(self) -> BufferMeta:
        return BufferMeta(
            device=self.device.type,
            pid=os.getpid(),
            fd=self.region.fd,
            region_id=self.region.id,
            capacity=self.capacity,
            cuda_ipc=self._ipc,
            started=own_start(),
        )


class MappedBuffer:
    """A reader's view of a writer's buffer: mapped (CPU) or opened (CUDA) once, reused."""

    def __init__(self, meta: BufferMeta):
        self.region_id = meta.region_id
        if meta.device == "cpu":
            self.region = _C.Region.open(meta.pid, meta.fd, meta.region_id, meta.capacity)
            self.data = self.region.tensor()
        else:
            self.region = _C.Region.open(meta.pid, meta.fd, meta.region_id, 0)
            rebuild, args = meta.cuda_ipc
            self.data = rebuild(*args)
        self._views: dict[tuple, torch.Tensor] = {}

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The bytes at `offset` as a tensor (made once per layout: versions repeat theirs)."""
        return cached_view(self._views, self.data, offset, dtype, shape)

    def prepare(self, generation: int, ranges: list[tuple[int, int]], part: PartMeta, wait, deadline=None) -> None:
        """Nothing to do: the writer's bytes are mapped here (RemoteBuffer fetches them)."""

    def check(self, generation: int, written: int | None = None) -> bool:
        """True if the bytes copied out are those of `generation` (call after copying): the
        generation is unchanged, or, for a buffer read while written (`written`: the end of
        what was copied), the same write is still under way and has passed that end."""
        if self.data.is_cuda:
            torch.cuda.synchronize(self.data.device)
        if self.region.unchanged_since(generation):
            return True
        return (written is not None and self.region.generation() == generation - 1
                and self.region.progress() >= written)

    def state(self, generation: int) -> str:
        """"whole" if the bytes are those of `generation` now, "writing" if the write that
        makes them is under way, "pending" if it has not begun (the writer publishes a part
        before writing it), "replaced" if a later write began (call before copying)."""
        now = self.region.generation()
        if now == generation:
            return "whole"
        if now == generation - 1:
            return "writing"
        return "pending" if now < generation else "replaced"

    def progress(self) -> int:
        return self.region.progress()


def cached_view(cache: dict, data: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    key = (offset, dtype, shape)
    view = cache.get(key)
    if view is None:
        if len(cache) > 65536:  # a writer whose layout changes every version
            cache.clear()
        view = cache[key] = typed_view(data, offset, dtype, shape)
    return view


# On CUDA a run of at least this many bytes is copied on its own: a plain copy runs at
# cudaMemcpy's speed, about 1.4x torch's batched copy kernel's on an H100, and from about 7 MB
# on its copy takes longer than the next launch (~5 us), so launches stay ahead of the device.
_ALONE = 8 << 20


@dataclass
class CopyGroup:
    """Copies run_copies makes in one call: `how` is 'cpu' (loom's parallel copy of
    contiguous CPU pairs of one dtype), 'cuda' (one launch of loom's spread copy, for such
    pairs on one CUDA device), 'alone' (one plain copy_) or 'batched' (torch._foreach_copy_)."""

    how: str
    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]


def _loom_copies(dst: torch.Tensor, src: torch.Tensor) -> str | None:
    """'cpu' or 'cuda' if loom's own copy takes the pair (contiguous, one dtype, one device),
    else None."""
    if dst.dtype != src.dtype or dst.device != src.device or not (dst.is_contiguous() and src.is_contiguous()):
        return None
    if dst.device.type == "cpu" or (dst.device.type == "cuda" and _C.has_cuda_copy):
        return dst.device.type
    return None


def copy_groups(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> list[CopyGroup]:
    """The pairs (dst, src) grouped by how they are copied, empty tensors left out, and pairs
    that continue the previous one in both memories (tensors back to back, as in a writer's
    buffer and often in a reader's) joined into one copy of bytes: what run_copies takes
    (plans make it once and run it every read)."""
    groups: dict[tuple, tuple[list, list]] = {}
    lazy: list[CopyGroup] = []
    for dst, src in zip(dsts, srcs):
        if dst.numel() == 0:
            continue
        if _lazy(dst) or _lazy(src):
            # A conjugate or negative view's bytes are not its values: a plain copy_ resolves
            # them (loom's copies and joins move bytes; torch's batched copy refuses such a dst).
            lazy.append(CopyGroup("alone", [dst], [src]))
            continue
        into, out_of = groups.setdefault((dst.device, src.device, _loom_copies(dst, src)), ([], []))
        if into and _continues(into[-1], dst) and _continues(out_of[-1], src) and dst.dtype == src.dtype:
            into[-1], out_of[-1] = _joined(into[-1], dst), _joined(out_of[-1], src)
        else:
            into.append(dst)
            out_of.append(src)
    out = lazy
    for (_, _, loom), (into, out_of) in groups.items():
        if loom is not None:
            out.append(CopyGroup(loom, into, out_of))
            continue
        alone = [d.numel() * d.element_size() >= _ALONE for d in into]
        out.extend(CopyGroup("alone", [d], [s]) for d, s, a in zip(into, out_of, alone) if a)
        rest = [(d, s) for d, s, a in zip(into, out_of, alone) if not a]
        if rest:
            out.append(CopyGroup("batched", [d for d, _ in rest], [s for _, s in rest]))
    return out


def _lazy(tensor: torch.Tensor) -> bool:
    """True for a conjugate or negative view (torch resolves the bit only when it reads values)."""
    return tensor.is_conj() or tensor.is_neg()


def _continues(before: torch.Tensor, after: torch.Tensor) -> bool:
    """True if `after` starts where `before` ends, in the same memory, both contiguous."""
    return (before.is_contiguous() and after.is_contiguous() and before.device == after.device
            and before.data_ptr() + before.numel() * before.element_size() == after.data_ptr()
            and before.untyped_storage().data_ptr() == after.untyped_storage().data_ptr())


def _joined(first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The bytes from the start of `first` to the end of `last` (same storage) as one tensor."""
    storage = first.untyped_storage()
    start = first.data_ptr() - storage.data_ptr()
    end = last.data_ptr() + last.numel() * last.element_size() - storage.data_ptr()
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (end - start,))


def run_copies(groups: list[CopyGroup], job_bytes: int = 0) -> None:
    """dst.copy_(src) for every pair: contiguous CPU pairs in one parallel loom copy (with
    streaming stores when the job, of which these may be a bucket of `job_bytes`, is larger
    than the cache), contiguous pairs on one CUDA device in one launch of loom's spread copy;
    otherwise one batched torch call per group (a few kernel launches for all its tensors,
    where a loop would pay a launch for each) and a plain copy for a run copied alone."""
    for group in groups:
        if group.how == "cpu":
            _C.copy_cpu(group.dsts, group.srcs, job_bytes)
        elif group.how == "cuda":
            _C.copy_cuda(group.dsts, group.srcs, _ALONE)
        elif group.how == "alone":
            group.dsts[0].copy_(group.srcs[0])
        else:
            torch._foreach_copy_(group.dsts, group.srcs)


def pickled_tensor(value: Any, what: str) -> torch.Tensor:
    """A pickled object as uint8 bytes, to store beside tensors; one pickle refuses is named
    as `what` (the verb and entry)."""
    try:
        data = bytearray(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as error:  # pickle raises several kinds
        raise TypeError(f"{what} is not a tensor and cannot be pickled ({type(error).__name__}: "
                        f"{error}); store only tensors and picklable values") from error
    return torch.frombuffer(data, dtype=torch.uint8)


def unpickled(data: torch.Tensor) -> Any:
    out = bytearray(data.numel())
    if out:
        torch.frombuffer(out, dtype=torch.uint8).copy_(data)
    return pickle.loads(out)
