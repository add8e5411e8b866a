"""What the tensor-store tests share: sample tensors of every dtype, counts of this process's
store buffers, a reader's refresh loop and a wait on the job's Store."""

from __future__ import annotations

import os
from datetime import timedelta

import torch


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.complex64]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype)


def store_buffers() -> tuple[int, int]:
    """(descriptors, mappings) this process holds of tensor-store regions."""
    fds = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fds += "loom-tensor-store" in os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = sum("loom-tensor-store" in line for line in f)
    return fds, maps


def refresh_until(ts, mine: dict, last: float, what: str) -> list[float]:
    """A generator's loop: reads the latest version of "policy" into `mine` until it has seen
    `last`, checking that every read is one whole version (every tensor one value)."""
    seen: list[float] = []
    while not seen or seen[-1] < last:
        if not ts.exists("policy"):
            continue
        ts.get_state_dict("policy", mine)
        values = {float(mine["w"].min()), float(mine["w"].max()), float(mine["b"].min()), float(mine["b"].max())}
        assert len(values) == 1, f"a torn read{what}: {values}"
        seen.append(values.pop())
    return seen


def sync(store, name, timeout=60):
    store.wait([name], timedelta(seconds=timeout))


def on_wait(ts, signal) -> None:
    """Calls signal() each time TensorStore `ts` is about to wait in the Store for a version
    not put yet (so a test knows its reader is waiting)."""
    real = ts._wait

    def waiting(*args):
        signal()
        return real(*args)

    ts._wait = waiting
