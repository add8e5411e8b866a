"""Broadcast mode: one writer's state dict delivered to every member of a process group at
once, in pipelined buckets over the group's broadcast (the way checkpoint-engine updates
many generators). Where a get makes every reader fetch its own copy, a broadcast over loom
crosses each host's link once and spreads within a host through shared memory (CPU) or
CUDA IPC (GPU). Every member calls it; the writer's tensors are sent, the others' filled in
place.
"""

from __future__ import annotations

import collections
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ._arguments import is_version_number
from ._layout import flatten, is_dtensor, leaf_signature, path_text
from ._parts import CopyGroup, _lazy, copy_groups, run_copies, typed_view

# A tensor of at least 1/_ALONE_FRACTION of a bucket is broadcast on its own, in place.
_ALONE_FRACTION = 2


@dataclass
class Bucket:
    """One broadcast: a tensor alone (`alone`), or the leaves at `members` packed at `offsets`
    into `nbytes` bytes of a bucket buffer of `device`."""

    device: torch.device
    alone: int | None = None
    members: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0
    packing: list[CopyGroup] | None = None  # the copies into its buffer, made on first use
    unpacking: list[CopyGroup] | None = None  # and out of it


@dataclass
class BroadcastPlan:
    """A member's buckets for one layout of its state dict, reused call after call while
    its tensors stay the same (the signature says so)."""

    signature: tuple
    bucket_bytes: int  # the writer's: every member must cut the same buckets
    buckets: list[Bucket]
    buffers: dict[torch.device, list[torch.Tensor]]  # two bucket buffers per device, in turn


def layout_of(leaves: list[tuple[tuple, Any]]) -> list[tuple]:
    """What a receiver checks its own leaves against: each tensor's path, dtype, shape and
    device type, in order; None for a leaf that is not a tensor (sent as an object)."""
    return [(path, v.dtype, tuple(v.shape), v.device.type) if isinstance(v, torch.Tensor) else (path, None)
            for path, v in leaves]


def mismatch(mine: list[tuple], theirs: list[tuple]) -> str | None:
    """Why a receiver's layout cannot take the writer's, or None."""
    if [entry[0] for entry in mine] != [entry[0] for entry in theirs]:
        have, want = {e[0] for e in mine}, {e[0] for e in theirs}
        missing = sorted(path_text(p) for p in want - have)[:8]
        unexpected = sorted(path_text(p) for p in have - want)[:8]
        if missing or unexpected:
            return f"names differ: not in this rank's state dict: {missing}; only in it: {unexpected}"
        return "the same names in another order (build both state dicts the same way)"
    for m, t in zip(mine, theirs):
        if (m[1] is None) != (t[1] is None):
            return f"'{path_text(m[0])}' is a tensor on one side only"
        if m[1] is not None and m[1:] != t[1:]:
            return (f"'{path_text(m[0])}' is {m[1]} {list(m[2])} on {m[3]} here, "
                    f"{t[1]} {list(t[2])} on {t[3]} at the writer")
    return None


def plan_buckets(tensors: list[tuple[int, torch.Tensor]], bucket_bytes: int) -> list[Bucket]:
    """Buckets in leaf order per device: large tensors alone, the rest packed (64-byte
    aligned) up to `bucket_bytes`. Decided by sizes alone, which every member's layout
    shares, so every member issues the same broadcasts (strides may differ between them)."""
    open_bucket: dict[torch.device, Bucket] = {}
    buckets: list[Bucket] = []
    for index, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            continue
        if nbytes * _ALONE_FRACTION >= bucket_bytes:
            buckets.append(Bucket(tensor.device, alone=index))
            continue
        bucket = open_bucket.get(tensor.device)
        start = (bucket.nbytes + 63) // 64 * 64 if bucket else 0
        if bucket is None or (start + nbytes > bucket_bytes and bucket.members):
            bucket = open_bucket[tensor.device] = Bucket(tensor.device)
            buckets.append(bucket)
            start = 0
        bucket.members.append(index)
        bucket.offsets.append(start)
        bucket.nbytes = start + nbytes
    return buckets


def views(bucket: Bucket, buffer: torch.Tensor, tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Where each member of a packed bucket sits in `buffer`, as a tensor like the member."""
    members = [tensors[i] for i in bucket.members]
    return [typed_view(buffer, o, t.dtype, tuple(t.shape)) for o, t in zip(bucket.offsets, members)]


def run_broadcasts(plan: BroadcastPlan, tensors: list[torch.Tensor | None], sending: bool, src: int, group) -> None:
    """The buckets' broadcasts, two in flight: the writer packs the next bucket while the last
    one moves, a receiver unpacks a bucket while the next one moves."""
    in_flight: collections.deque = collections.deque()

    def unpack(work, bucket: Bucket, buffer: torch.Tensor | None) -> None:
        work.wait()
        if sending:
            return
        # Filled as load_state_dict fills, whatever the grad mode: otherwise torch's copies
        # (into a tensor that is not contiguous) refuse a leaf that requires grad (a Parameter).
        with torch.no_grad():
            if bucket.alone is None:
                if bucket.unpacking is None:
                    bucket.unpacking = copy_groups([tensors[i] for i in bucket.members], views(bucket, buffer, tensors))
                run_copies(bucket.unpacking)
            elif buffer is not None:  # a strided tensor received through a contiguous copy
                tensors[bucket.alone].copy_(buffer)

    turn: dict[torch.device, int] = collections.Counter()
    for bucket in plan.buckets:
        if len(in_flight) == 2:
            unpack(*in_flight.popleft())
        if bucket.alone is not None:
            tensor = tensors[bucket.alone]
            staged = None if tensor.is_contiguous() and not _lazy(tensor) else _staged(tensor, sending)
            work = dist.broadcast(tensor if staged is None else staged, src=src, group=group, async_op=True)
            in_flight.append((work, bucket, staged))
            continue
        buffer = plan.buffers[bucket.device][turn[bucket.device] % 2]
        turn[bucket.device] += 1
        if sending:
            if bucket.packing is None:
                bucket.packing = copy_groups(views(bucket, buffer, tensors), [tensors[i] for i in bucket.members])
            run_copies(bucket.packing)
        work = dist.broadcast(buffer.narrow(0, 0, bucket.nbytes), src=src, group=group, async_op=True)
        in_flight.append((work, bucket, buffer))
    while in_flight:
        unpack(*in_flight.popleft())


def _staged(tensor: torch.Tensor, sending: bool) -> torch.Tensor:
    """The plain contiguous tensor a strided tensor, or a conjugate or negative view (whose
    bytes are not its values), moves through: its values, to send; memory to receive into,
    copied back as copy_ does."""
    if sending:
        return tensor.resolve_conj().resolve_neg().contiguous()
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)


def make_plan(leaves: list[tuple[tuple, Any]], bucket_bytes: int) -> BroadcastPlan:
    """Buckets and bucket buffers for these leaves."""
    tensors = [(i, v) for i, (_, v) in enumerate(leaves) if isinstance(v, torch.Tensor)]
    buckets = plan_buckets(tensors, bucket_bytes)
    buffers: dict[torch.device, list[torch.Tensor]] = {}
    for bucket in buckets:
        if bucket.alone is None and bucket.device not in buffers:
            size = max(b.nbytes for b in buckets if b.alone is None and b.device == bucket.device)
            buffers[bucket.device] = [torch.empty(size, dtype=torch.uint8, device=bucket.device) for _ in range(2)]
    return BroadcastPlan(leaf_signature(leaves), bucket_bytes, buckets, buffers)


def unfillable(leaves: list[tuple[tuple, Any]]) -> str | None:
    """Why a receiver cannot fill one of its tensors in place, as copy_ would refuse it, or
    None. Found before any broadcast: a receiver that raised while unpacking a bucket would
    stop issuing the later ones, and the others would wait in them until their timeout."""
    for path, value in leaves:
        if not isinstance(value, torch.Tensor):
            continue
        if value.is_inference() and not torch.is_inference_mode_enabled():
            return (f"'{path_text(path)}' is an inference tensor, which torch lets no one change in "
                    f"place outside torch.inference_mode(): call it inside inference_mode(), or "
                    f"with tensors made outside it")
        if torch._debug_has_internal_overlap(value) == 1:  # 1: its elements share memory
            return (f"'{path_text(path)}' has elements that share memory (an expanded tensor), so "
                    f"it cannot take one value per element: pass a tensor of its own memory")
    return None


def dtensor_problem(leaves: list[tuple[tuple, Any]]) -> str | None:
    """Why broadcast mode cannot send these leaves (DTensors), or None."""
    for path, value in leaves:
        if is_dtensor(value):
            return (f"'{path_text(path)}' is a DTensor; broadcast mode sends whole tensors (put "
                    f"DTensors with put_state_dict and read them with get_state_dict)")
    return None


def agreed(problem: str | None, group, what: str) -> None:
    """Raises on every member if any member found a problem, naming the first such rank and
    its reason: none goes on alone into broadcasts the others skip. One small all_reduce when
    all is well."""
    try:
        device = dist.distributed_c10d._get_object_coll_device(group)
    except AttributeError:  # a torch without it: CPU, which every loom and Gloo group takes
        device = torch.device("cpu")
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() == 0:
        return
    found: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, problem, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    rank, reason = next((r, why) for r, why in zip(ranks, found) if why is not None)
    raise ValueError(f"{what}: rank {rank}: {reason}")


class Broadcaster:
    """A store's broadcast mode: the plans and versions of the keys it broadcast."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self.plans: dict[str, BroadcastPlan] = {}
        self.versions: dict[str, int] = {}

    def run(self, state_dict: dict, key: str, src: int, group, version: int | None, what: str,
            problem: str | None = None) -> int:
        """TensorStore.broadcast_state_dict after its argument checks: the version, the
        layouts checked and agreed, the buckets, the objects. Returns the version. `problem`:
        what is wrong with this member's arguments, raised on every member."""
        leaves = list(flatten(state_dict)) if problem is None else []
        sending = dist.get_rank() == src
        header: list[Any] = [None]
        if sending:
            last = self.versions.get(key, 0)
            if problem is not None:
                header[0] = problem
            elif version is not None and not is_version_number(version):
                header[0] = (f"versions are Python ints (got {type(version).__name__}; int(...) "
                             f"converts a numpy integer)")
            elif version is not None and version <= last:
                header[0] = f"versions must be integers that grow; the last of this key is {last}"
            else:
                objects = {i: v for i, (_, v) in enumerate(leaves) if not isinstance(v, torch.Tensor)}
                # The writer's bucket size goes along: members made with another bucket_bytes
                # would cut other buckets and issue broadcasts of other sizes.
                header[0] = (version if version is not None else last + 1, layout_of(leaves), objects,
                             self.bucket_bytes)
                # A leaf that cannot travel fails broadcast_object_list on this rank alone,
                # before it sends anything: the members would wait for the header until their
                # timeout. Said in the header instead, so that every member raises it.
                try:
                    pickle.dumps(header[0])
                except Exception as error:  # noqa: BLE001  (pickling raises many types)
                    header[0] = (f"a leaf of its state dict cannot be pickled to send "
                                 f"({type(error).__name__}: {error}); leave it out or make it picklable")
        dist.broadcast_object_list(header, src=src, group=group)
        if isinstance(header[0], str):
            raise ValueError(f"{what}: rank {src}: {header[0]}")
        version, layout, objects, bucket_bytes = header[0]
        if problem is None:
            problem = dtensor_problem(leaves) or (
                None if sending else mismatch(layout_of(leaves), layout) or unfillable(leaves))
        agreed(problem, group, what)
        plan = self.plans.get(key)
        if plan is None or plan.signature != leaf_signature(leaves) or plan.bucket_bytes != bucket_bytes:
            plan = self.plans[key] = make_plan(leaves, bucket_bytes)
        tensors = [v if isinstance(v, torch.Tensor) else None for _, v in leaves]
        run_broadcasts(plan, tensors, sending, src, group)
        if not sending:
            # Filled behind autograd's back (loom's copies, c10d's broadcast): a tensor saved
            # for backward must be seen as changed, as after load_state_dict's copy_ (its
            # backward then refuses to run instead of using the new values).
            torch.autograd.graph.increment_version(
                [t for t in tensors if t is not None and not t.is_inference()])
            for i, value in objects.items():
                node = state_dict
                for name in leaves[i][0][:-1]:
                    node = node[name]
                node[leaves[i][0][-1]] = value
        self.versions[key] = version
        return version
