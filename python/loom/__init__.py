"""loom: a native PyTorch distributed backend: CPU tensors within and across hosts, CUDA
tensors among the ranks of one host (several may share a GPU).

``import loom`` registers the backend ``"loom"``; then::

    dist.init_process_group("loom")                 # CPU and CUDA tensors through loom
    dist.init_process_group("cpu:loom,cuda:nccl")   # CPU through loom, CUDA through NCCL

To let ``init_process_group()`` with no backend pick loom for CPU tensors (the way PyTorch
picks XCCL on Intel GPUs), call ``loom.make_default()`` or set ``LOOM_DEFAULT=1`` before
importing loom. To run framework code that asks for ``"gloo"`` by name on loom, call
``loom.replace_gloo()`` or set ``LOOM_REPLACES_GLOO=1`` (never on by default).

Frameworks that fix their backend list in code (accelerate, and through it the transformers
Trainer) accept ``backend="loom"`` once loom is imported: see ``loom._integrations``.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# Debian's libfabric loads libinfinipath (its PSM provider), which otherwise replaces the
# interpreter's SIGINT and SIGTERM handlers and the crash signals' defaults with its own,
# that print a backtrace and exit(1): Ctrl-C would no longer raise KeyboardInterrupt.
os.environ.setdefault("IPATH_NO_BACKTRACE", "1")

from . import _C, _integrations, ops  # noqa: E402
from ._openmp_hint import hint_wait_policy as _hint_wait_policy
from ._backend_names import BACKEND_NAME, env_flag as _env_flag, make_default, replace_gloo

__all__ = [
    "is_available",
    "make_default",
    "replace_gloo",
    "flight_record",
    "format_flight_record",
    "progress_report",
    "ProcessGroupLoom",
    "BACKEND_NAME",
]

ProcessGroupLoom = _C.ProcessGroupLoom


def is_available() -> bool:
    """True if the loom backend is registered and usable in this process."""
    return dist.is_available() and BACKEND_NAME in dist.Backend.backend_list


def _create_backend(dist_backend_opts, backend_options) -> ProcessGroupLoom:
    # torch's extended API: the store arrives already prefixed for this group.
    _hint_wait_policy(dist_backend_opts.group_rank, dist_backend_opts.group_size)
    timeout = dist_backend_opts.timeout
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout))
    return ProcessGroupLoom(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        timeout,
        # Messages and failure reports name the group: torch calls the world group "0".
        dist_backend_opts.group_id if dist_backend_opts.global_ranks_in_group else "default_pg",
        [int(r) for r in dist_backend_opts.global_ranks_in_group],
        _torch_factory=True,  # torch's world, and groups over its ranks, derive from one another
    )


def _register() -> None:
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    # cuda only where torch has it: torch picks a backend's first non-CPU device for some of
    # its own work (ShardedTensor.gather) and calls into CUDA there.
    devices = ["cpu", "cuda"] if torch.backends.cuda.is_built() else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=devices)


_register()
_integrations.install()


def _shut_down_at_exit() -> None:
    """loom's exit handler: before the interpreter starts finalising, every loom group still
    alive is shut down (what destroy_process_group does), so the calls left pending end and
    let go of their tensors while loom's threads may still take the GIL. Left to finalisation,
    a thread that takes the GIL to free a tensor is ended by Python inside a destructor, and
    the process aborts ("terminate called without an active exception", as Gloo's can:
    pytorch/pytorch#179291). A group whose calls are still under way 10 s after its shutdown
    began (a peer that never joins them, a call on a daemon thread) has them aborted."""
    if _C._shut_down_live_groups() and threading.active_count() > 1:
        # A daemon thread whose loom call has just ended needs the GIL to leave it; once
        # finalisation has begun, Python ends a thread that asks for it, and inside loom's
        # C++ that aborts the process. The GIL is its for a moment.
        time.sleep(0.05)


# Registered at import, so it runs after the exit handlers registered later (they may still
# use their groups) and before those registered earlier (they find the groups shut down).
atexit.register(_shut_down_at_exit)
if _env_flag("LOOM_DEFAULT"):
    make_default()
if _env_flag("LOOM_REPLACES_GLOO"):
    replace_gloo()


def flight_record() -> list[dict]:
    """This process's recent loom operations (every group), oldest first: one dict per
    operation with its group, rank, sequence number, arguments, state ("queued", "running",
    "completed", "failed"), issue time (seconds since the epoch), milliseconds queued and
    running, and the error of a failed one. ``LOOM_FLIGHT_RECORDER`` sets how many are kept
    (default 1024; 0 turns recording off). loom prints the last few on stderr by itself when
    an operation times out, a peer dies or ranks disagree."""
    return _C.flight_record()


def format_flight_record() -> str:
    """:func:`flight_record` as a table, for logs."""
    return _C.format_flight_record()


def progress_report(group=None) -> str:
    """What every rank of ``group`` (default: the world) last started and finished, read
    from shared memory: which rank is behind, which is stuck inside a collective, which died."""
    pg = group if group is not None else c10d._get_default_group()
    if not isinstance(pg, dist.ProcessGroup):  # torch's token for a group this rank is not in
        raise ValueError(f"loom.progress_report (rank {dist.get_rank()}): this rank is not a "
                         "member of the group; ask on one of its ranks")
    backend = pg._get_backend(torch.device("cpu"))
    while hasattr(backend, "wrapped_pg"):  # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps backends
        backend = backend.wrapped_pg
    if not isinstance(backend, ProcessGroupLoom):
        raise ValueError(
            f"loom.progress_report: the group's CPU backend is {type(backend).__name__}, not "
            "loom's; pass a group made with backend='loom' (or 'cpu:loom,...')")
    return backend.progress_report()
