"""Which backend a name asked for becomes: loom as the default CPU backend
(:func:`loom.make_default`, ``LOOM_DEFAULT=1``) and, opt-in, loom in place of Gloo
(:func:`loom.replace_gloo`, ``LOOM_REPLACES_GLOO=1``).

torch turns every backend name it is given (by ``init_process_group``, ``new_group``, and for
each half of ``"cpu:gloo,cuda:nccl"``) into its canonical form with ``Backend(name)``, and an
unspecified backend into ``Backend("undefined")``. loom hooks that one constructor, so a choice
made here reaches every caller: code that imported ``init_process_group`` before loom, DeviceMesh's
implicit initialisation, and frameworks that pass ``"gloo"`` by name.

Why not only ``Backend.default_device_backend_map["cpu"] = "loom"``: for an unspecified backend
torch 2.13 builds the group from that map but pins its default backend type to Gloo whenever NCCL
is absent, and the first collective then fails with "Could not find backend type 1 for Process
Group with name gloo". Resolving "undefined" to "loom" here avoids that path; the map is set as
well, for the code that reads it directly (Lightning's ``strategy="ddp"``,
``get_default_backend_for_device``).
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import BackendConfig

BACKEND_NAME = "loom"

_log = logging.getLogger("loom")

_is_default = False  # make_default() was called
_replaces_gloo = False  # replace_gloo() was called


def default_backend() -> str:
    """What an unspecified backend becomes: loom for CPU, NCCL for CUDA where present."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return f"cpu:{BACKEND_NAME},cuda:nccl"
    return BACKEND_NAME


def gloo_replaced() -> bool:
    """Whether groups asked for as "gloo" run on loom in this process (``replace_gloo``)."""
    return _replaces_gloo


def _instead_of_gloo() -> str:
    if not getattr(_instead_of_gloo, "logged", False):
        _instead_of_gloo.logged = True
        _log.warning("loom: loom.replace_gloo() is in effect (called, or LOOM_REPLACES_GLOO=1 "
                     "at import), so process groups asked for as 'gloo' run on loom in this "
                     "process (logged once)")
    return BACKEND_NAME


def _rename(name: str) -> str:
    """The backend a canonical name becomes under loom's choices. Evaluated when a group is
    made, not when a choice is made: asking about CUDA at import time would initialise it
    before the caller forks its ranks."""
    if name == dist.Backend.UNDEFINED:
        if _is_default:
            return default_backend()
        # torch would take the map's entry for this machine's accelerator (Gloo without one).
        accelerator = torch.accelerator.current_accelerator()
        device = accelerator.type if accelerator is not None else "cpu"
        if _replaces_gloo and dist.Backend.default_device_backend_map.get(device) == dist.Backend.GLOO:
            return _instead_of_gloo()
    elif name == dist.Backend.GLOO and _replaces_gloo:
        return _instead_of_gloo()
    return name


def _install_hook() -> None:
    """Makes ``Backend(name)`` apply ``_rename`` (once per process)."""
    backend_type = dist.Backend
    original = backend_type.__new__
    if getattr(original, "_loom", False):
        return

    def __new__(cls, name):
        return _rename(original(cls, name))

    __new__._loom = True
    backend_type.__new__ = staticmethod(__new__)


def make_default() -> None:
    """Makes an unspecified backend (``init_process_group()`` in torchrun scripts, DeviceMesh's
    implicit initialisation) use loom for CPU tensors, and NCCL for CUDA tensors where present,
    and makes loom the CPU entry of ``Backend.default_device_backend_map`` for the code that reads
    it (Lightning's ``strategy="ddp"``). Call it before the process group is made. Idempotent."""
    global _is_default
    _install_hook()
    _is_default = True
    dist.Backend.default_device_backend_map["cpu"] = BACKEND_NAME


def replace_gloo() -> None:
    """Runs every process group that would be Gloo on loom: asked for as ``"gloo"`` (also the
    CPU half of ``"cpu:gloo,cuda:nccl"``) or left unspecified on a host without an accelerator.
    For framework code that names Gloo and cannot be changed. Logged once per process when it
    first takes effect. Idempotent."""
    global _replaces_gloo
    _install_hook()
    _replaces_gloo = True


def is_default() -> bool:
    """True if :func:`make_default` is in effect."""
    return _is_default


def device_backends(name: str | None) -> dict[str, str]:
    """What a group asked for as `name` would use per device type, after loom's renames
    (``None`` is the unspecified backend)."""
    resolved = dist.Backend(name if name is not None else dist.Backend.UNDEFINED)
    with warnings.catch_warnings():  # torch warns about names it has no devices for
        warnings.simplefilter("ignore")
        config = BackendConfig(resolved)
    return {device: str(backend) for device, backend in config.get_device_backend_map().items()}


def env_flag(name: str) -> bool:
    """A LOOM_* on/off variable; anything but the usual spellings is an error naming it."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={os.environ[name]!r} is not a switch: set it to 1 (on) or 0 (off), or unset it")
