"""Where each stored tensor sits in the global tensor, and copying the overlap of two boxes.

A stored piece is a box of a global tensor: its offset and shape along every dimension. A
plain tensor is one box covering all of itself; a DTensor shard is the box its placements
give it. A reader asks for a box (a whole tensor, its own DTensor shard, or a slice spec)
and gets it assembled from every stored box that overlaps it, so shardings may differ
between writers and readers (FSDP shards in, tensor-parallel shards out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .. import _C


@dataclass(frozen=True)
class Box:
    """A block of a global tensor: where it starts and how big it is, per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def overlap(self, other: "Box") -> "Box | None":
        """The block both cover, or None."""
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offset, self.shape, other.offset, other.shape))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    def view_of(self, tensor: torch.Tensor, within: "Box") -> torch.Tensor:
        """The part of `tensor` (holding block `within`) that this block covers."""
        for dim, (start, size, base) in enumerate(zip(self.offset, self.shape, within.offset)):
            tensor = tensor.narrow(dim, start - base, size)
        return tensor


def whole(shape: torch.Size | tuple[int, ...]) -> Box:
    """The box of an entire tensor of `shape`."""
    return Box(tuple(0 for _ in shape), tuple(int(n) for n in shape))


_DTENSOR: Any = None


def is_dtensor(value: Any) -> bool:
    global _DTENSOR
    if _DTENSOR is None:
        from torch.distributed.tensor import DTensor

        _DTENSOR = DTensor
    return isinstance(value, _DTENSOR)


def dtensor_box(value: Any, what: str) -> tuple[Box, tuple[int, ...]]:
    """The box of this rank's shard of DTensor `value` and the global shape. Placements other
    than Shard and Replicate are refused: a Partial value is not yet a tensor anyone can read."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for placement in value.placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"{what} is a DTensor placed {type(placement).__name__} ({placement}); only Shard and "
                f"Replicate placements can be stored. Call .redistribute() to Shard or "
                f"Replicate (or .full_tensor()) before putting it.")
    global_shape = tuple(int(n) for n in value.shape)
    local_shape, global_offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements)
    return Box(tuple(int(o) for o in global_offset), tuple(int(n) for n in local_shape)), global_shape


def is_first_replica(value: Any) -> bool:
    """True on the one rank of each set of replicas that stores a DTensor's shard: the one at
    coordinate 0 along every mesh dimension the tensor is replicated over."""
    from torch.distributed.tensor import Replicate

    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(c == 0 for c, p in zip(coordinate, value.placements) if isinstance(p, Replicate))


def unstorable(value: torch.Tensor) -> str | None:
    """Why the store cannot keep tensor `value` (or a DTensor's shard) as it is, and what to do
    instead, to follow its name in a message; None if it can: its bytes must be its values in
    one strided block, on CPU or CUDA."""
    local = value.to_local() if is_dtensor(value) else value
    if local.is_nested:
        return "is a nested tensor; put its components (t.unbind()) as tensors of their own"
    if local.layout != torch.strided:
        return (f"is a sparse tensor ({local.layout}); only strided tensors can be stored: put "
                f"t.to_dense(), or its indices and values as tensors of their own")
    if local.is_quantized:
        return (f"is a quantized tensor ({local.dtype}); put t.dequantize(), or t.int_repr() and "
                f"its scale and zero point")
    if local.device.type not in ("cpu", "cuda"):
        return f"is on {local.device}; CPU and CUDA tensors can be stored: move it there first"
    return None


def flatten(state_dict: dict, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, leaf) for every leaf of a nested dict; a path is the tuple of keys to it."""
    for name, value in state_dict.items():
        path = prefix + (name,)
        if isinstance(value, dict) and value:
            yield from flatten(value, path)
        else:
            yield path, value


def unflatten(leaves: dict[tuple, Any]) -> dict:
    """The nested dict whose leaves are `leaves` (the inverse of flatten)."""
    out: dict = {}
    for path, value in leaves.items():
        node = out
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = value
    return out


def path_text(path: tuple) -> str:
    """A path for messages: the keys joined with dots, as torch names parameters."""
    return ".".join(str(p) for p in path)


def leaf_signature(leaves: list[tuple[tuple, Any]]) -> tuple:
    """What a plan over these leaves depends on: their names, each tensor's address, device,
    dtype, shape and strides (packed in C++: a lend or broadcast of a few hundred tensors
    checks it every time), and which leaves are not tensors."""
    tensors = [v for _, v in leaves if isinstance(v, torch.Tensor)]
    others = tuple(i for i, (_, v) in enumerate(leaves) if not isinstance(v, torch.Tensor))
    return tuple(path for path, _ in leaves), _C.tensors_signature(tensors), others


def shards_signature(tensors: list[torch.Tensor]) -> bytes:
    """leaf_signature's bytes for the tensors a plan copies from or into (a DTensor's shard,
    not its wrapper): they change with any tensor's address, dtype, shape or strides, as
    `.data =` (module.to(dtype)) or resize_ change them under the same tensor object."""
    with torch.no_grad():  # to_local() is then the shard itself, not an autograd view of it
        return _C.tensors_signature([t.to_local() if is_dtensor(t) else t for t in tensors])
