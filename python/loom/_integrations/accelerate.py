"""loom in Hugging Face accelerate, and so in the transformers Trainer, which sets up its
processes through accelerate.

accelerate decides the run's backend and kind in ``PartialState._prepare_backend`` from a fixed
list: for a CPU run it picks "mpi" or "gloo" and rejects any other name ("Your assigned backend
loom is not available, please use gloo"), and a launch without ``cpu=True`` on a host with no
accelerator becomes a not-distributed run, in which every rank silently trains a model of its own.
loom wraps that one method: when the backend asked for runs on loom, a CPU run of several
processes becomes accelerate's multi-CPU kind (DDP) on that backend, a GPU run keeps its kind
on it (loom carries CUDA tensors too), and what cannot work (a single process, tensors of a
device the backend asked for does not carry, such as "cpu:loom" alone on a GPU run) is an
error that says what to change. Any other backend goes to accelerate untouched.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

from .. import _backend_names

_LAUNCH_VARIABLES = ("LOCAL_RANK", "WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def _launched_distributed() -> bool:
    """True if this process is one of several started by a launcher (as accelerate reads it)."""
    if int(os.environ.get("LOCAL_RANK", -1)) != -1:
        return True
    return any(int(os.environ.get(v, 1)) > 1 for v in _LAUNCH_VARIABLES[1:])


def _accelerator_type() -> str:
    """The device type of this host's accelerator (asked only when accelerate found one)."""
    import torch

    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else "cuda"


def patch(state: ModuleType) -> None:
    """Wraps ``state.PartialState._prepare_backend`` (module ``accelerate.state``)."""
    partial_state = getattr(state, "PartialState", None)
    original = getattr(partial_state, "_prepare_backend", None)
    kinds = getattr(state, "DistributedType", None)
    if original is None or kinds is None or getattr(original, "_loom", False):
        return

    @functools.wraps(original)
    def _prepare_backend(self, cpu: bool = False, sagemaker_dp=False, backend: str | None = None):
        # An unspecified backend runs on loom too where loom was made the default, or
        # replaces Gloo on a host without an accelerator.
        if sagemaker_dp or _backend_names.device_backends(backend).get("cpu") != "loom":
            return original(self, cpu, sagemaker_dp, backend)
        # What accelerate makes of this machine and launch on its own.
        _, kind = original(self, cpu, sagemaker_dp, None)
        if kind not in (kinds.NO, kinds.MULTI_CPU):
            if backend is None:  # loom stands in only for CPU runs
                return original(self, cpu, sagemaker_dp, backend)
            device = _accelerator_type()
            if device not in _backend_names.device_backends(backend):
                raise ValueError(
                    f"loom: accelerate prepares a {kind} run (tensors on '{device}' devices), and "
                    f"backend {backend!r} carries no '{device}' tensors. Use backend "
                    f"'cpu:loom,{device}:<its backend>' (e.g. 'cpu:loom,cuda:nccl') to keep device "
                    f"tensors on the device's own backend, or pass cpu=True "
                    f"(TrainingArguments(use_cpu=True)) to train on CPUs through loom.")
            return backend, kind
        if not _launched_distributed():
            if backend is None:
                return original(self, cpu, sagemaker_dp, backend)
            raise ValueError(
                f"loom: accelerate was asked for backend {backend!r}, which joins the processes of "
                f"a distributed launch, but this process was started alone (none of "
                f"{', '.join(_LAUNCH_VARIABLES)} says otherwise). Start it with "
                f"`torchrun --nproc-per-node N` (or mpirun), or leave the backend unset to train "
                f"in one process.")
        # Several processes on CPUs: accelerate's multi-CPU run (DDP), whether or not the
        # caller said cpu=True.
        return (backend if backend is not None else _backend_names.BACKEND_NAME), kinds.MULTI_CPU

    _prepare_backend._loom = True
    partial_state._prepare_backend = _prepare_backend
