"""loom: a native PyTorch distributed backend for the CPU tensors of ranks on one host.

``import loom`` registers the backend ``"loom"``; then::

    dist.init_process_group("loom")                 # CPU tensors through loom
    dist.init_process_group("cpu:loom,cuda:nccl")   # CPU through loom, CUDA through NCCL

To let ``init_process_group()`` with no backend pick loom for CPU tensors (the way PyTorch
picks XCCL on Intel GPUs), call ``loom.make_default()`` or set ``LOOM_DEFAULT=1`` before
importing loom.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _C

__all__ = ["is_available", "make_default", "ProcessGroupLoom", "BACKEND_NAME"]

BACKEND_NAME = "loom"
ProcessGroupLoom = _C.ProcessGroupLoom


def is_available() -> bool:
    """True if the loom backend is registered and usable in this process."""
    return dist.is_available() and BACKEND_NAME in dist.Backend.backend_list


def _create_backend(dist_backend_opts, backend_options) -> ProcessGroupLoom:
    # torch's extended API: the store arrives already prefixed for this group.
    timeout = dist_backend_opts.timeout
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout))
    return ProcessGroupLoom(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        timeout,
        dist_backend_opts.group_id,
        [int(r) for r in dist_backend_opts.global_ranks_in_group],
    )


def make_default() -> None:
    """Makes ``init_process_group()`` with no backend use loom for CPU tensors (CUDA stays
    with NCCL)."""
    dist.Backend.default_device_backend_map["cpu"] = BACKEND_NAME


def _register() -> None:
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu"])


_register()
if os.environ.get("LOOM_DEFAULT", "") not in ("", "0"):
    make_default()
