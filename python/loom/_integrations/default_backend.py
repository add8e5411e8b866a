"""torch 2.13 (and 2.11) sets a process group's default backend, which its name, hooks and
sequence numbers come from, in _new_process_group_helper; for a spec of several halves
("cpu:gloo", "cpu:loom,cuda:loom") with no NCCL among them it means to pick the registered
plugin if the spec names it and Gloo otherwise, but once any plugin is registered it compares
the plugin's upper-case key with the spec's lower-case names and sets nothing. So `import
loom` alone left such groups with no default backend: `_get_backend_name()` read
"undefined", `_get_sequence_number_for_group()` raised, and destroying the group warned "No
backend of type 0 found". Wrapped, a group left so gets the default torch meant to give it."""

from __future__ import annotations


def _unset(pg) -> bool:
    try:
        return pg._get_backend_name() == "undefined"
    except RuntimeError:  # a torch that raises for a group with no default backend
        return True


def patch(c10d) -> None:
    """Wraps c10d._new_process_group_helper (idempotent)."""
    original = c10d._new_process_group_helper
    if getattr(original, "_loom_wrapped", False):
        return

    def _new_process_group_helper(group_size, group_rank, global_ranks_in_group, backend, *args,
                                  **kwargs):
        made = original(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs)
        pg = made[0] if isinstance(made, tuple) else made
        if isinstance(pg, c10d.ProcessGroup) and _unset(pg):
            names = set(c10d.BackendConfig(c10d.Backend(backend)).get_device_backend_map().values())
            plugins = {name.lower() for name in c10d.Backend._plugins}
            pg._set_default_backend(c10d.ProcessGroup.BackendType.CUSTOM if names & plugins
                                    else c10d.ProcessGroup.BackendType.GLOO)
        return made

    _new_process_group_helper._loom_wrapped = True
    _new_process_group_helper.__doc__ = original.__doc__
    c10d._new_process_group_helper = _new_process_group_helper
