"""What loom's extension module exports to the process: its own interface only. Code the module
takes from static archives (libloom.a, and libstdc++ where a compiler links it statically, as
the GPU hosts' does) must stay private to it: an exported copy of the C++ library mixes with
the libstdc++.so torch loaded, and writing a number into an ostringstream crashed there
(docs/perf/cuda_timing_h100.txt). The link option that keeps them private is
`--exclude-libs,ALL` (torch_plugin/CMakeLists.txt)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

import loom._C

OWN_PREFIXES = ("PyInit__C", "loom::torch_plugin::")
THUNKS = ("non-virtual thunk to ", "virtual thunk to ")  # a method's entry through a base class
# Stream and locale machinery lives in libstdc++ alone (explicitly instantiated there): the
# module defines it only when it carries a static copy of the library.
CXX_RUNTIME = ("std::basic_ostream<char, std::char_traits<char> >::_M_insert", "std::locale::",
               "std::ios_base::", "std::basic_ios<")


def exported_definitions() -> list[tuple[str, str]]:
    """(symbol type, demangled name) of every symbol the module defines in its dynamic table."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed: cannot list the module's exports")
    out = subprocess.run([nm, "-D", "-C", "--defined-only", loom._C.__file__],
                         capture_output=True, text=True, check=True).stdout
    symbols = []
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3:
            symbols.append((parts[1], parts[2]))
    return symbols


def own(name: str) -> bool:
    """Whether an exported function is the module's own (a thunk counts as its method's)."""
    for thunk in THUNKS:
        name = name.removeprefix(thunk)
    return name.startswith(OWN_PREFIXES)


def test_every_strong_function_exported_is_the_modules_own():
    foreign = [name for kind, name in exported_definitions()
               if kind == "T" and not own(name)]
    assert not foreign, (f"loom._C exports {len(foreign)} functions of the archives it links, "
                         f"e.g. {foreign[:5]}")


def test_no_copy_of_the_cxx_runtime_is_exported():
    runtime = [name for _, name in exported_definitions()
               if any(marker in name for marker in CXX_RUNTIME)]
    assert not runtime, (f"loom._C exports {len(runtime)} symbols of the C++ library's streams "
                         f"and locales, e.g. {runtime[:5]}")
