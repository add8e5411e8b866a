"""Python run from the checkout imports the real packages: no top-level folder is named like a
module that loom's code, tests, examples or scripts import. (A folder `torch/` once made
`python3 -c "import torch"` succeed on a machine without torch, as an empty namespace package,
so setup skipped installing it and the build failed later.)"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tracked_files() -> list[Path]:
    try:
        done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if done.returncode != 0:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    return [ROOT / line for line in done.stdout.splitlines() if (ROOT / line).exists()]


def imported_top_level_names() -> set[str]:
    """The first component of every absolute import in the checkout's Python files, and of
    every `import X` in the Python one-liners of its shell scripts and CMake files."""
    names: set[str] = set()
    for path in tracked_files():
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
        elif path.suffix in (".sh", ".txt") or path.name == "run":
            names.update(re.findall(r"\bimport ([A-Za-z_]\w*)", path.read_text()))
    return names


def test_no_top_level_folder_is_named_like_an_imported_module():
    folders = {path.relative_to(ROOT).parts[0] for path in tracked_files() if len(path.relative_to(ROOT).parts) > 1}
    imported = imported_top_level_names()
    assert {"torch", "loom"} <= imported, f"the scan found only {sorted(imported)}: it is broken"
    clash = folders & imported
    assert not clash, f"top-level folders named like imported modules: {sorted(clash)} (rename them)"


def test_torch_and_loom_import_from_the_environment_when_run_from_the_checkout():
    code = "import torch, loom; print(torch.__file__); print(loom.__file__); print(torch.__version__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    torch_file, loom_file, _version = done.stdout.split()
    for module_file in (torch_file, loom_file):
        # A package's __init__.py sits in a folder of some sys.path entry: that entry must not
        # be the checkout (a virtual environment inside it, as CI's, is fine).
        assert Path(module_file).parent.parent != ROOT, f"imported from the checkout: {module_file}"
