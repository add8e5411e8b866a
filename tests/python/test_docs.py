"""The documentation says what the code does: docs/CONFIGURATION.md lists exactly the LOOM_*
environment variables loom reads, and tests/README.md the ones its tests and scripts read."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Where loom itself lives (engine, torch plugin, Python package, loom-bench), and where its
# tests and scripts do.
LIBRARY = ["src", "include", "torch_plugin", "python/loom", "bench"]
TESTING = ["tests", "scripts", ".ci"]

NAME = r"LOOM_[A-Z][A-Z0-9_]*"
STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'')
TEST_READ = re.compile(r"""(?:getenv\(|environ\.get\(|environ\[)\s*["'](""" + NAME + ")")
SHELL_READ = re.compile(r"\$\{?(" + NAME + ")")


def files(folders: list[str], suffixes: tuple[str, ...]) -> list[Path]:
    return [p for f in folders for p in (ROOT / f).rglob("*")
            if p.is_file() and (p.suffix in suffixes or (".sh" in suffixes and p.name == "run"))]


def library_reads() -> set[str]:
    """LOOM_* names in the string literals of loom's C++ and Python: every variable it reads is
    named in a string (getenv, env::text, env_flag), and build-time macros
    (LOOM_HAVE_X86_KERNELS, CMake options) never are."""
    names: set[str] = set()
    for path in files(LIBRARY, (".cc", ".h", ".py")):
        for literal in STRING.findall(path.read_text()):
            names.update(re.findall(r"\b" + NAME, literal))
    return names


def read_by_tests() -> set[str]:
    """Variables the tests and scripts read themselves (getenv, os.environ, $VAR in shell). A
    fixture that a test sets and hands to loom's parser, like config_test.cc's, is not one."""
    names: set[str] = set()
    for path in files(TESTING, (".cc", ".h", ".py")):
        text = path.read_text()
        # A name the same file also sets for its ranks (an environment list, setenv) is how it
        # passes itself a value.
        names.update(n for n in TEST_READ.findall(text) if not re.search(r'(?:\{|setenv\()\s*"' + n, text))
    for path in files(TESTING, (".sh",)):
        names.update(SHELL_READ.findall(path.read_text()))
    return names - library_reads()


def documented(page: Path) -> set[str]:
    """Variables a page lists in the first cell of a table row."""
    return set(re.findall(r"^\| `(" + NAME + r")` \|", page.read_text(), re.M))


def test_configuration_page_lists_what_loom_reads():
    read = library_reads()
    listed = documented(ROOT / "docs" / "CONFIGURATION.md")
    assert {"LOOM_THREADS", "LOOM_DEFAULT"} <= read, f"the scan found only {sorted(read)}: it is broken"
    assert not read - listed, f"read by loom but missing from docs/CONFIGURATION.md: {sorted(read - listed)}"
    assert not listed - read, f"in docs/CONFIGURATION.md but read nowhere: {sorted(listed - read)}"


def test_tests_readme_lists_what_the_tests_read():
    read = read_by_tests()
    listed = documented(ROOT / "tests" / "README.md")
    assert "LOOM_SOAK_SECONDS" in read, f"the scan found only {sorted(read)}: it is broken"
    assert not read - listed, f"read by the tests but missing from tests/README.md: {sorted(read - listed)}"
    assert not listed - read, f"in tests/README.md but read nowhere: {sorted(listed - read)}"
