"""The reader's side of planning: which bytes of a stored version land in which of the
reader's tensors (a value, a slice of it, a DTensor's shard, a state dict filled in place),
checked against what was stored before any byte is copied. TensorStore inherits it."""

from __future__ import annotations

from typing import Any

import torch

from ._layout import Box, flatten, is_dtensor, path_text, unflatten, whole
from ._parts import PartMeta
from ._read_plan import ReadPlan, TensorStoreError, pieces_by_path

# A part's kind, for messages.
KINDS = {"tensor": "a tensor", "object": "an object", "state_dict": "a state dict"}


class ReadPlanning:
    """The plans TensorStore's reads run; it supplies _message, _name, _dtensor_box, _keep and
    _read_plans (the plans kept per key for state dicts filled in place)."""

    def _value_plan(self, key: str, version: int, parts: list[PartMeta], inplace: Any, slice_spec: Any) -> ReadPlan:
        """The copies that read a tensor (whole, a slice, or into `inplace`) or an object."""
        entries = pieces_by_path(parts)
        pieces = entries.get(())
        if pieces is None:
            if inplace is not None or slice_spec is not None:
                raise ValueError(self._message(f"'{key}' version {version} is a state dict: use get_state_dict"))
            return self._state_dict_plan(key, version, parts, None, True)
        plan = ReadPlan(self, parts)
        if pieces[0][1].pickled:
            if inplace is not None or slice_spec is not None:
                argument = "inplace_tensor" if inplace is not None else "tensor_slice_spec"
                raise ValueError(self._message(f"'{key}' version {version} is an object, not a tensor: get it without {argument}"))
            plan.add_object((), pieces[0])
            plan.result = lambda objects: objects[()]
            return plan
        want, dst = self._target(key, version, (), pieces, inplace, slice_spec)
        self._assemble(key, version, (), pieces, want, dst, plan)
        if inplace is not None:
            plan.fill(inplace, dst, like_copy=True)
        plan.result = lambda objects: inplace if inplace is not None else dst
        return plan

    def _state_dict_plan(self, key: str, version: int, parts: list[PartMeta], user: dict | None,
                         strict: bool) -> ReadPlan:
        """The copies that fill `user` (or new tensors) from `parts`; for a user's state dict,
        made once and reused while the layout and the user's tensors stay the same."""
        if parts[0].kind != "state_dict":
            raise ValueError(self._message(f"'{key}' version {version} is {KINDS[parts[0].kind]}, not a "
                                           f"state dict: use get"))
        # A part's tensor list is shared by every version decoded from the same layout bytes;
        # `strict` is part of the key, since a plan made without it skipped the names' check.
        cache_key = ((key, tuple(id(p.tensors) for p in parts), id(user), strict)
                     if user is not None else None)
        if cache_key is not None:
            plan = self._read_plans.get(key, {}).get(cache_key)
            # A plan another thread runs now is not shared (its parts and limits are per read).
            if plan is not None and not plan.in_use and plan.still_fits(user):
                plan.parts = parts
                return plan
        entries = pieces_by_path(parts)
        plan = ReadPlan(self, parts)
        if user is None:
            leaves: dict[tuple, Any] = {}
            for path, pieces in entries.items():
                if pieces[0][1].pickled:
                    plan.add_object(path, pieces[0])
                else:
                    want, dst = self._target(key, version, path, pieces, None, None)
                    self._assemble(key, version, path, pieces, want, dst, plan)
                    leaves[path] = dst
            plan.result = lambda objects: unflatten({**leaves, **objects})
            return plan
        leaves = dict(flatten(user))
        if strict:
            missing_paths = [p for p in leaves if p not in entries]
            unexpected_paths = [p for p in entries if p not in leaves]
            # A nested entry and a flat one whose key holds the dots read alike ('b.c'): where
            # they would, both are written as the keys they are (['b']['c'] against ['b.c']).
            alike = {path_text(p) for p in missing_paths} & {path_text(p) for p in unexpected_paths}

            def shown(path: tuple) -> str:
                return "".join(f"[{k!r}]" for k in path) if path_text(path) in alike else self._name(path)

            missing = [shown(p) for p in missing_paths]
            unexpected = [shown(p) for p in unexpected_paths]
            if missing or unexpected:
                def listed(names: list[str]) -> str:
                    return (", ".join(names[:8]) or "none") + (", ..." if len(names) > 8 else "")

                raise KeyError(self._message(
                    f"get_state_dict('{key}') version {version}: names differ (strict=True): "
                    f"not stored: {listed(missing)}; stored but not asked for: {listed(unexpected)}"))
        replaced: dict[tuple, torch.Tensor] = {}
        for path, value in leaves.items():
            pieces = entries.get(path)
            if pieces is None:
                continue
            if pieces[0][1].pickled and not isinstance(value, torch.Tensor):
                plan.add_object(path, pieces[0])
                continue
            # (A tensor to fill where an object is stored is refused by _target, by name: it
            # would otherwise be replaced in the dict, leaving the tensor, a model's
            # parameter say, as it was.)
            dst = value if isinstance(value, torch.Tensor) else None
            want, into = self._target(key, version, path, pieces, dst, None)
            self._assemble(key, version, path, pieces, want, into, plan)
            if dst is None:
                replaced[path] = into
            else:
                plan.fill(dst, into, like_copy=False)

        def result(objects: dict) -> dict:
            for path, value in {**replaced, **objects}.items():  # the leaves that are not tensors
                node = user
                for name in path[:-1]:
                    node = node[name]
                node[path[-1]] = value
            return user

        plan.result = result
        if not replaced:  # tensors filled in place: the same copies serve the next version
            plan.remember_leaves(leaves)
            # One plan per layout the writer rotates through (its `keep` buffers), for one
            # state dict of the reader's: a new one replaces them all. At most `keep`: each
            # plan holds its mappings of the writer's buffers, which would otherwise outlive
            # ReaderMappings' `keep` per buffer (a restarted writer's every buffer, say).
            plans = self._read_plans.setdefault(key, {})
            if any(k[2] != cache_key[2] for k in plans) or len(plans) >= self._keep:
                plans.clear()
            plans[cache_key] = plan
        return plan

    def _assemble(self, key: str, version: int, path: tuple, pieces, want: Box, dst: torch.Tensor, plan) -> None:
        """Plans copying block `want` of the tensor at `path` into `dst` from every piece over it."""
        if len(pieces) == 1 and pieces[0][1].box == want:  # the common case: no resharding
            plan.copy(dst, *pieces[0])
            return
        covered = 0
        for part, meta in pieces:
            block = want.overlap(meta.box)
            if block is None:
                continue
            plan.copy(block.view_of(dst, want), part, meta, lambda src, block=block, meta=meta: block.view_of(src, meta.box))
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
        if dst is not None and dst.device.type == "meta":
            raise ValueError(self._message(f"{what}: the tensor to fill is on the meta device and holds no "
                                           f"data; materialise it first (to_empty), or get without it"))
        local = dst.to_local() if is_dtensor(dst) else dst
        if dst is not None and local.layout != torch.strided:
            raise ValueError(self._message(f"{what}: the tensor to fill is {str(local.layout).split('.')[-1]}; "
                                           f"it must be a dense (strided) tensor: fill a dense one, then "
                                           f"convert it (to_sparse)"))
        if dst is not None and torch._debug_has_internal_overlap(local) == 1:
            raise ValueError(self._message(f"{what}: the tensor to fill has elements that share memory (an "
                                           f"expanded tensor), so it cannot take one value per element: "
                                           f"pass a tensor of its own memory"))
        if dst is not None and dst.dtype != stored.dtype:
            raise ValueError(self._message(f"{what} is stored as {stored.dtype}; the tensor to fill is {dst.dtype}"))
        if dst is not None and is_dtensor(dst):
            if slice_spec is not None:
                raise ValueError(self._message(f"{what}: a DTensor to fill says which block it reads; "
                                               f"pass it without tensor_slice_spec"))
            want, global_shape = self._dtensor_box(dst, what)
            if global_shape != stored.global_shape:
                raise ValueError(self._message(f"{what} has global shape {list(stored.global_shape)}; the DTensor to fill has {list(global_shape)}"))
            return want, dst.to_local()
        if slice_spec is not None:
            offsets, shape = _slice_of(slice_spec, self._message(f"{what}: tensor_slice_spec"))
            want = Box(offsets, shape)
            if len(shape) != len(stored.global_shape) or any(
                    o < 0 or n < 0 or o + n > g for o, n, g in zip(offsets, shape, stored.global_shape)):
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


def _slice_of(spec: Any, what: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) from a slice spec: torchstore's TensorSlice (offsets, local_shape) or
    a pair; anything else is refused, `what` naming it."""
    try:
        if hasattr(spec, "offsets") and hasattr(spec, "local_shape"):
            offsets, shape = spec.offsets, spec.local_shape
        else:
            offsets, shape = spec
        offsets, shape = tuple(int(o) for o in offsets), tuple(int(n) for n in shape)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be (offsets, local_shape), two sequences of integers, or a "
                         f"TensorSlice; got {spec!r}") from None
    if len(offsets) != len(shape):
        raise ValueError(f"{what} has {len(offsets)} offsets but {len(shape)} sizes")
    return offsets, shape
