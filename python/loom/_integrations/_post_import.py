"""Running a function on a module right after it is imported, whether that happens before or
after ``import loom``: how loom adapts frameworks that fix their list of backends in code."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Callable

_pending: dict[str, list[Callable[[ModuleType], None]]] = {}


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Calls ``callback(module)`` once module `name` has executed: now if it already has."""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        callback(module)
        return
    _pending.setdefault(name, []).append(callback)
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module someone waits on, it asks the other finders for the
    spec and makes its loader call the callbacks after executing the module."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        # A loader that is a class (builtin, frozen) is shared by many modules: leave it be.
        if spec is None or isinstance(spec.loader, type) or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        # Set on this spec's own loader object (finders make one per module), so the loader's
        # type is unchanged for anything that inspects it.
        def exec_module(module: ModuleType) -> None:
            execute(module)
            for callback in _pending.pop(fullname, []):
                callback(module)

        spec.loader.exec_module = exec_module
        return spec
