"""Adapters for frameworks that fix their list of backends in code, applied when the framework
is imported (before or after loom). Each module says what it changes and why."""

from __future__ import annotations

from torch.distributed import distributed_c10d

from . import accelerate, default_backend, torch_timeouts
from ._post_import import when_imported


def install() -> None:
    """Arranges every adapter (idempotent)."""
    when_imported("accelerate.state", accelerate.patch)
    torch_timeouts.patch(distributed_c10d)
    default_backend.patch(distributed_c10d)
