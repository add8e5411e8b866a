"""torch.ops.loom.*: loom's collectives as torch operators, for callers that cannot afford
c10d's Work and future on every call (tensor-parallel inference: an all_reduce of a few KiB
between layers). Each names its group by string, as torch's functional collectives do, and
returns once the collective is done::

    import loom, torch, torch.distributed as dist
    dist.init_process_group("loom")
    name = dist.group.WORLD.group_name
    torch.ops.loom.all_reduce_(x, "sum", name)            # in place, returns None
    y = torch.ops.loom.all_reduce(x, "sum", name)         # into a new tensor
    torch.ops.loom.broadcast_(x, 0, name)                 # src is a rank of the group
    g = torch.ops.loom.all_gather_into_tensor(x, dist.get_world_size(), name)
    r = torch.ops.loom.reduce_scatter_tensor(g, "sum", dist.get_world_size(), name)
    a = torch.ops.loom.all_to_all_single(x, [], [], name)  # [] : equal splits
    torch.ops.loom.all_gather_into_tensor_out(x, n, name, out=g)  # into g, returns None

The gather, reduce-scatter and all-to-all forms that return a new tensor allocate it on
every call; for CPU tensors of tens of MiB that is fresh memory the kernel faults in and
zeroes each time, which costs more than the collective (docs/PERFORMANCE.md). Their *_out
forms (all_gather_into_tensor_out, reduce_scatter_tensor_out, all_to_all_single_out, as
torch's functional collectives spell them) write into a tensor the caller keeps.

The same nine are plain functions of this module too (``loom.ops.all_reduce_(x, "sum",
name)``, same arguments): called eagerly they go straight to loom without torch's operator
dispatch, about half the instructions of a small torch.ops.loom call
(docs/PERFORMANCE.md), which is what a latency-bound caller wants; inside torch.compile,
under any torch dispatch mode (make_fx, fake tensors), under torch.jit.trace and functorch's
transforms (vmap, grad, functionalize), and for tensor subclasses with their own dispatch
(DTensor, wrapper subclasses), for meta tensors and for torch.fx.symbolic_trace's proxies,
they are the operators above, so one spelling serves both. (Tensor subclasses that only
override __torch_function__ are not consulted by the eager functions: call the operators for
those. torch.func.functionalize refuses custom operators that write their arguments, so
under it only the forms that return a new tensor work; torch.compile (auto_functionalized)
functionalizes the written forms as well.)

reduce_op is one of sum, avg, product, min, max, band, bor, bxor. Results equal those of
the torch.distributed calls on the same group. Contiguous CPU tensors go straight to the
communicator on the calling thread; CUDA and other tensors take the group's c10d path with
async_op=False (on the caller's current stream). They are not part of a coalescing block.
torch.compile traces them (the fake kernels below give the output shapes).
"""

from __future__ import annotations

import torch

from . import _C  # defines the operators and their eager functions

_is_compiling = torch.compiler.is_compiling
# A torch dispatch mode is active while make_fx traces (its proxy mode, with fake tensors
# their mode too) and under FakeTensorMode: the operator must be called then so that the
# trace records it and fake tensors reach its fake kernel, not the communicator.
_dispatch_modes = torch._C._len_torch_dispatch_stack
# What is no tensor but has a __torch_function__ (torch.fx.symbolic_trace's proxies) reaches
# the operator, which consults it: the eager function refuses it (a TypeError from its
# argument conversion), so the check costs the tensors' path nothing.
_torch_function = torch._C._has_torch_function

# The nine wrappers below are written out rather than made by one helper taking *args: the
# helper (argument packing and a lookup by name) cost 851 more instructions per call, 12% of
# an eager 8-byte all_reduce_ (scripts/call_cost.py), on the path these exist to shorten.


def all_reduce_(tensor: torch.Tensor, reduce_op: str, group_name: str) -> None:
    """Reduces `tensor` across the group in place (torch.ops.loom.all_reduce_)."""
    if _is_compiling() or _dispatch_modes():
        return torch.ops.loom.all_reduce_(tensor, reduce_op, group_name)
    try:
        return _C.eager_all_reduce_(tensor, reduce_op, group_name)
    except TypeError:
        if not _torch_function((tensor,)):
            _explain("all_reduce_", reduce_op=reduce_op, group_name=group_name)
            raise
    return torch.ops.loom.all_reduce_(tensor, reduce_op, group_name)


def all_reduce(input: torch.Tensor, reduce_op: str, group_name: str) -> torch.Tensor:
    """The reduction of `input` across the group, in a new tensor (torch.ops.loom.all_reduce)."""
    if _is_compiling() or _dispatch_modes():
        return torch.ops.loom.all_reduce(input, reduce_op, group_name)
    try:
        return _C.eager_all_reduce(input, reduce_op, group_name)
    except TypeError:
        if not _torch_function((input,)):
            _explain("all_reduce", reduce_op=reduce_op, group_name=group_name)
            raise
    return torch.ops.loom.all_reduce(input, reduce_op, group_name)


def broadcast_(tensor: torch.Tensor, src: int, group_name: str) -> None:
    """Overwrites `tensor` with rank `src`'s (torch.ops.loom.broadcast_)."""
    if _is_compiling() or _dispatch_modes():
        return torch.ops.loom.broadcast_(tensor, src, group_name)
    try:
        return _C.eager_broadcast_(tensor, src, group_name)
    except TypeError:
        if not _torch_function((tensor,)):
            _explain("broadcast_", group_name=group_name)
            raise
    return torch.ops.loom.broadcast_(tensor, src, group_name)


def all_gather_into_tensor(input: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Every rank's `input`, rows in rank order (torch.ops.loom.all_gather_into_tensor)."""
    if _is_compiling() or _dispatch_modes():
        return torch.ops.loom.all_gather_into_tensor(input, group_size, group_name)
    try:
        return _C.eager_all_gather_into_tensor(input, group_size, group_name)
    except TypeError:
        if not _torch_function((input,)):
            _explain("all_gather_into_tensor", group_name=group_name)
            raise
    return torch.ops.loom.all_gather_into_tensor(input, group_size, group_name)


def reduce_scatter_tensor(input: torch.Tensor, reduce_op: str, group_size: int,
                          group_name: str) -> torch.Tensor:
    """This rank's block of rows of the reduction (torch.ops.loom.reduce_scatter_tensor)."""
    if _is_compiling() or _dispatch_modes():
        return torch.ops.loom.reduce_scatter_tensor(input, reduce_op, group_size, group_name)
    try:
        return _C.eager_reduce_scatter_tensor(input, reduce_op, group_size, group_name)
    except TypeError:
        if not _torch_function((input,)):
            _explain("reduce_scatter_tensor", reduce_op=reduce_op, group_name=group_name)
            raise
    return torch.ops.loom.reduce_scatter_tensor(input, reduce_op, group_size, group_name)


def all_to_all_single(input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                      group_name: str) -> torch.Tensor:
    """Rows exchanged with every rank ([] for equal splits; torch.ops.loom.all_to_all_single)."""
    if _is_compiling() or _dispatch_modes():
        return torch.ops.loom.all_to_all_single(input, output_split_sizes, input_split_sizes, group_name)
    try:
        return _C.eager_all_to_all_single(input, output_split_sizes, input_split_sizes, group_name)
    except TypeError:
        if not _torch_function((input,)):
            _explain("all_to_all_single", group_name=group_name)
            raise
    return torch.ops.loom.all_to_all_single(input, output_split_sizes, input_split_sizes, group_name)


def all_gather_into_tensor_out(input: torch.Tensor, group_size: int, group_name: str, *,
                               out: torch.Tensor) -> torch.Tensor:
    """all_gather_into_tensor into `out` (group_size x input's elements), which it returns
    (torch.ops.loom.all_gather_into_tensor_out)."""
    if _is_compiling() or _dispatch_modes():
        torch.ops.loom.all_gather_into_tensor_out(input, group_size, group_name, out=out)
        return out
    try:
        _C.eager_all_gather_into_tensor_out(input, group_size, group_name, out)
        return out
    except TypeError:
        if not _torch_function((input, out)):
            _explain("all_gather_into_tensor_out", group_name=group_name)
            raise
    torch.ops.loom.all_gather_into_tensor_out(input, group_size, group_name, out=out)
    return out


def reduce_scatter_tensor_out(input: torch.Tensor, reduce_op: str, group_size: int, group_name: str,
                              *, out: torch.Tensor) -> torch.Tensor:
    """reduce_scatter_tensor into `out` (input's elements / group_size), which it returns
    (torch.ops.loom.reduce_scatter_tensor_out)."""
    if _is_compiling() or _dispatch_modes():
        torch.ops.loom.reduce_scatter_tensor_out(input, reduce_op, group_size, group_name, out=out)
        return out
    try:
        _C.eager_reduce_scatter_tensor_out(input, reduce_op, group_size, group_name, out)
        return out
    except TypeError:
        if not _torch_function((input, out)):
            _explain("reduce_scatter_tensor_out", reduce_op=reduce_op, group_name=group_name)
            raise
    torch.ops.loom.reduce_scatter_tensor_out(input, reduce_op, group_size, group_name, out=out)
    return out


def all_to_all_single_out(input: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                          group_name: str, *, out: torch.Tensor) -> torch.Tensor:
    """all_to_all_single into `out`, which it returns (torch.ops.loom.all_to_all_single_out)."""
    if _is_compiling() or _dispatch_modes():
        torch.ops.loom.all_to_all_single_out(input, output_split_sizes, input_split_sizes, group_name,
                                             out=out)
        return out
    try:
        _C.eager_all_to_all_single_out(input, output_split_sizes, input_split_sizes, group_name, out)
        return out
    except TypeError:
        if not _torch_function((input, out)):
            _explain("all_to_all_single_out", group_name=group_name)
            raise
    torch.ops.loom.all_to_all_single_out(input, output_split_sizes, input_split_sizes, group_name, out=out)
    return out


_REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")


def _explain(op: str, **arguments) -> None:
    """After the eager function refused its arguments' types: raises a TypeError that names
    loom.ops.`op`, the argument and what to pass where one of `arguments` is the usual slip
    (a ProcessGroup for its name, torch's ReduceOp for a string); returns otherwise."""
    group_name = arguments.get("group_name")
    if not isinstance(group_name, str):
        hint = " (pass its .group_name)" if hasattr(group_name, "group_name") else ""
        raise TypeError(f"loom.ops.{op}: group_name must be a str, a group's name such as "
                        f"dist.group.WORLD.group_name, not {type(group_name).__name__}{hint}") from None
    if "reduce_op" in arguments and not isinstance(arguments["reduce_op"], str):
        raise TypeError(f"loom.ops.{op}: reduce_op must be a str, one of {', '.join(_REDUCE_OPS)}, "
                        f"not {type(arguments['reduce_op']).__name__}") from None


@torch.library.register_fake("loom::all_reduce_")
def _all_reduce_inplace_fake(tensor, reduce_op, group_name):
    return None


@torch.library.register_fake("loom::all_reduce")
def _all_reduce_fake(input, reduce_op, group_name):
    return torch.empty_like(input, memory_format=torch.contiguous_format)


@torch.library.register_fake("loom::broadcast_")
def _broadcast_fake(tensor, src, group_name):
    return None


def _require_group_size(op: str, group_size: int) -> None:
    # The eager kernel's refusal, so that a traced call fails with a message, not a
    # ZeroDivisionError or an empty output.
    if group_size < 1:
        raise RuntimeError(f"loom {op}: group_size is {group_size}; pass the group's size "
                           "(dist.get_world_size(group))")


@torch.library.register_fake("loom::all_gather_into_tensor")
def _all_gather_fake(input, group_size, group_name):
    _require_group_size("all_gather_into_tensor", group_size)
    shape = list(input.shape) or [1]
    shape[0] = shape[0] * group_size if input.dim() else group_size
    return input.new_empty(shape)


@torch.library.register_fake("loom::reduce_scatter_tensor")
def _reduce_scatter_fake(input, reduce_op, group_size, group_name):
    # The eager kernel's checks, so that a traced call fails with its message, not an IndexError.
    _require_group_size("reduce_scatter_tensor", group_size)
    rows = input.shape[0] if input.dim() else 1
    if input.dim() == 0 or rows % group_size != 0:
        raise RuntimeError(f"loom reduce_scatter_tensor: input has {rows} rows, which do not divide "
                           f"evenly among {group_size} ranks")
    shape = list(input.shape)
    shape[0] //= group_size
    return input.new_empty(shape)


@torch.library.register_fake("loom::all_to_all_single")
def _all_to_all_fake(input, output_split_sizes, input_split_sizes, group_name):
    shape = list(input.shape) or [1]
    if output_split_sizes:
        shape[0] = sum(output_split_sizes)
    return input.new_empty(shape)


@torch.library.register_fake("loom::all_gather_into_tensor_out")
def _all_gather_out_fake(input, group_size, group_name, *, out):
    return None


@torch.library.register_fake("loom::reduce_scatter_tensor_out")
def _reduce_scatter_out_fake(input, reduce_op, group_size, group_name, *, out):
    return None


@torch.library.register_fake("loom::all_to_all_single_out")
def _all_to_all_out_fake(input, output_split_sizes, input_split_sizes, group_name, *, out):
    return None
