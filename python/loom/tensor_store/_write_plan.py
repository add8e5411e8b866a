"""What a writer keeps per key: the versions it holds, and where each piece of a value goes
in its buffers (planned once while the leaves are the same tensors)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from ._layout import is_dtensor, shards_signature
from ._parts import OwnedBuffer, TensorMeta, aligned


@dataclass
class Kept:
    version: int
    index: int
    parts: int
    buffers: list[OwnedBuffer]


class WritePlan:
    """Where a writer puts each piece of a value: one buffer per device, each piece at an
    aligned offset. Reused put after put while the leaves are the same tensors."""

    def __init__(self, identity: tuple, leaves: list[tuple[tuple, Any]], pieces: list[tuple[TensorMeta, int, Any]]):
        self.identity = identity
        self.refs = [weakref.ref(v) if isinstance(v, torch.Tensor) else None for _, v in leaves]
        self.signature = shards_signature([v for _, v in leaves if isinstance(v, torch.Tensor)])
        self.leaf_of = [i for _, i, _ in pieces]
        self.pickled = {n: data for n, (_, _, data) in enumerate(pieces) if data is not None}
        self.cacheable = not self.pickled and all(r is not None for r in self.refs)
        ends: dict[torch.device, int] = {}
        self.metas: list[TensorMeta] = []
        device_of = []
        for n, (meta, i, data) in enumerate(pieces):
            device = data.device if data is not None else leaves[i][1].device
            device_of.append(device)
            offset = ends.get(device, 0)
            ends[device] = offset + aligned(meta.nbytes)
            self.metas.append(replace(meta, offset=offset))
        self.devices = sorted(ends, key=str)
        self.capacity = [ends[d] for d in self.devices]
        for n, device in enumerate(device_of):
            self.metas[n] = replace(self.metas[n], buffer=self.devices.index(device))
        self.pieces_on = [[n for n, d in enumerate(device_of) if d == device] for device in self.devices]
        self.layouts: dict[tuple, bytes] = {}  # encoded part layout, by the buffers' region ids

    def alive(self, leaves: list[tuple[tuple, Any]]) -> bool:
        """True if the leaves are still the tensors this plan was made for, with the dtypes,
        shapes, strides and memory they had then."""
        return (all(ref is not None and ref() is value for ref, (_, value) in zip(self.refs, leaves))
                and shards_signature([value for _, value in leaves]) == self.signature)

    def sources(self, leaves: list[tuple[tuple, Any]]) -> list[torch.Tensor]:
        """The tensor each piece copies from, this put."""
        out = []
        for n, i in enumerate(self.leaf_of):
            data = self.pickled.get(n)
            if data is not None:
                out.append(data)
            else:
                value = leaves[i][1]
                out.append(value.to_local() if is_dtensor(value) else value)
        return out
