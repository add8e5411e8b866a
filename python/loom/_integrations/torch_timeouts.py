"""torch.distributed.distributed_c10d._set_pg_timeout sets the timeout of Gloo and NCCL
backends only (a list fixed in its code) and warns for any other. dist.breakpoint() calls it
on every group to give peers an hour while one rank sits in the debugger: on a loom group
they failed at the group's own timeout. Wrapped, it sets loom's backends' timeout too, and
hands the rest (an NCCL half of "cpu:loom,cuda:nccl") to torch's own."""

from __future__ import annotations

from datetime import timedelta


def patch(c10d) -> None:
    """Wraps c10d._set_pg_timeout (idempotent)."""
    original = c10d._set_pg_timeout
    if getattr(original, "_loom_wrapped", False):
        return

    def _set_pg_timeout(timeout: timedelta, group=None) -> None:
        from .. import ProcessGroupLoom

        target = group if group is not None else c10d._get_default_group()
        if c10d._rank_not_in_group(target):
            return original(timeout, group)  # torch's own error
        looms, others = {}, False
        for device in target._device_types:
            backend = target._get_backend(device)
            while hasattr(backend, "wrapped_pg"):  # TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper
                backend = backend.wrapped_pg
            if isinstance(backend, ProcessGroupLoom):
                looms[id(backend)] = backend
            else:
                others = True
        if not looms:
            return original(timeout, group)
        for backend in looms.values():
            backend.set_timeout(timeout)
        if others:
            original(timeout, group)

    _set_pg_timeout._loom_wrapped = True
    _set_pg_timeout.__doc__ = original.__doc__
    c10d._set_pg_timeout = _set_pg_timeout
