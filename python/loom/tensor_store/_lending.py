"""Lending: a writer publishes its own tensors instead of a copy of them.

make_lendable moves a module's (or a state dict's) tensors once into one store buffer per
device, the kind a put copies into, keeping each tensor's identity, so the module, its
optimizer and every later state_dict() see the same memory. A lend then publishes where each
tensor sits in those buffers: no bytes move until readers copy them out. The buffer's
generation is the lent version's guard: even while lent, odd from reclaim (the writer is
about to change its tensors) until the next lend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._layout import flatten, is_dtensor, leaf_signature, path_text, unstorable, whole
from ._parts import OwnedBuffer, TensorMeta, _lazy, aligned


def lendable_tensors(target: Any, what: str, already) -> list[tuple[str, torch.Tensor]]:
    """The distinct tensors of a module (parameters and buffers) or of a state dict, named,
    that are not `already(tensor)` lendable, after checking that each can move into a store
    buffer without breaking anything."""
    if isinstance(target, torch.nn.Module):
        named = list(target.named_parameters()) + [(n, b) for n, b in target.named_buffers() if b is not None]
    elif isinstance(target, dict):
        named = [(path_text(path), v) for path, v in flatten(target) if isinstance(v, torch.Tensor)]
    else:
        raise TypeError(f"{what}: takes a torch.nn.Module or a state dict, got {type(target).__name__}")
    seen: set[int] = set()
    out = []
    for name, tensor in named:
        if id(tensor) in seen:  # tied weights: one tensor, two names
            continue
        seen.add(id(tensor))
        if is_dtensor(tensor):
            raise ValueError(f"{what}: '{name}' is a DTensor; its memory belongs to its sharding "
                             f"(FSDP, tensor parallel): put DTensors with put_state_dict")
        problem = unstorable(tensor)
        if problem is not None:
            raise ValueError(f"{what}: '{name}' {problem}")
        if already(tensor):  # moved before
            continue
        # Moving one of two tensors that share memory would part them silently (the other
        # keeps the old memory). A lone tensor's storage has two users here: the tensor and
        # the storage object this call makes.
        if torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) > 2:
            raise ValueError(
                f"{what}: '{name}' shares its memory with another tensor (a view of it, or a state "
                f"dict taken from the module before this call, which holds aliases); make it "
                f"lendable first, then take views and state dicts")
        out.append((name, tensor))
    return out


def move_into(buffer: OwnedBuffer, tensors: list[tuple[torch.Tensor, int]]) -> None:
    """Copies each (tensor, offset) into `buffer` and makes the tensor a view of it there
    (`.data` assignment keeps the object: parameters stay parameters, optimizers keep them)."""
    with torch.no_grad():
        for tensor, offset in tensors:
            view = buffer.view(offset, tensor.dtype, tuple(tensor.shape))
            view.copy_(tensor)
            tensor.data = view


def move_to_new_buffers(tensors: list[torch.Tensor], new_buffer) -> list[OwnedBuffer]:
    """Moves `tensors` (move_into) into one buffer per device, each made by
    new_buffer(device, bytes); returns the buffers."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_device.setdefault(tensor.device, []).append(tensor)
    buffers = []
    for device, on_device in by_device.items():
        offsets, end = [], 0
        for tensor in on_device:
            offsets.append(end)
            end += aligned(tensor.numel() * tensor.element_size())
        buffers.append(new_buffer(device, max(end, 1)))
        move_into(buffers[-1], list(zip(on_device, offsets)))
    return buffers


@dataclass
class LendPlan:
    """Where the tensors of one lent value sit in the store's buffers: reused lend after lend
    while the leaves have the same names, places and shapes (a fresh model.state_dict() holds
    new tensor objects over the same memory)."""

    signature: tuple  # leaf_signature of the leaves it was made for
    buffers: list[OwnedBuffer]
    metas: list[TensorMeta]
    layout: bytes = b""  # the encoded part layout, made on first publication


@dataclass
class Lent:
    """A key this writer lends: the version out now and what it lends."""

    kind: str
    leaves: list[tuple[tuple, Any]]  # kept for updating(): lent again as they are
    plan: LendPlan


def take_back(buffers: list[OwnedBuffer]) -> None:
    """Marks each buffer as being changed (its generation odd), unless it already is: a reader
    copying from it now will not keep the copy."""
    for buffer in buffers:
        if buffer.region.generation() % 2 == 0:
            buffer.region.begin_write()


def lent_metas(leaves: list[tuple[tuple, Any]], lendable: list[OwnedBuffer], what: str) -> LendPlan:
    """Finds every leaf in the store's lendable buffers; refuses what cannot be lent as it is."""
    used: list[OwnedBuffer] = []
    metas = []
    for path, value in leaves:
        name = f"'{path_text(path)}'" if path else "the value"
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what}: {name} is a {type(value).__name__}; only tensors can be lent "
                            f"(put other values under a key of their own)")
        if is_dtensor(value):
            raise ValueError(f"{what}: {name} is a DTensor; put DTensors with put_state_dict")
        problem = unstorable(value)
        if problem is not None:
            raise ValueError(f"{what}: {name} {problem}")
        if not value.is_contiguous():
            raise ValueError(f"{what}: {name} is not contiguous; lend the tensors make_lendable moved, "
                             f"not views of them")
        if _lazy(value):  # its memory holds other values than torch shows, and readers copy the memory
            raise ValueError(f"{what}: {name} is a {'conjugate' if value.is_conj() else 'negative'} "
                             f"view, whose memory holds the values before the "
                             f"{'conjugation' if value.is_conj() else 'negation'}; lend the tensor "
                             f"make_lendable moved, or put() this one (a copy by value)")
        home, offset = _home(value, used, lendable)
        if home is None:
            raise ValueError(f"{what}: {name} is not in memory this store lends; call "
                             f"store.make_lendable(model) (or on the state dict) once before lending")
        if home not in used:
            used.append(home)
        metas.append(TensorMeta(path, value.dtype, whole(value.shape), tuple(value.shape),
                                used.index(home), offset))
    return LendPlan(leaf_signature(leaves), used, metas)


def start_of(tensor: torch.Tensor) -> int:
    """Where `tensor`'s bytes start: its data_ptr(), except for an empty tensor, whose
    data_ptr() is 0 even as a view into a buffer: there, where its storage puts it."""
    if tensor.numel():
        return tensor.data_ptr()
    return tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()


def home_of(tensor: torch.Tensor, lendable: list[OwnedBuffer]) -> OwnedBuffer | None:
    """The lendable buffer `tensor` lies in, or None."""
    start, nbytes = start_of(tensor), tensor.numel() * tensor.element_size()
    return next((b for b in lendable if b.device == tensor.device
                 and b.base <= start and start + nbytes <= b.base + b.capacity), None)


def _home(value: torch.Tensor, used: list[OwnedBuffer], lendable: list[OwnedBuffer]) -> tuple[OwnedBuffer | None, int]:
    """The lendable buffer `value` lives in and its offset there (None if it lives in none).
    An empty tensor that make_lendable did not move has no bytes to guard: any buffer of its
    device serves (one this lend uses already, if any), at offset 0."""
    home = home_of(value, lendable)
    if home is not None:
        return home, start_of(value) - home.base
    if value.numel() == 0:
        return next((b for b in used + lendable if b.device == value.device), None), 0
    return None, 0
