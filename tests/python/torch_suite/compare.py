"""Runs PyTorch's generic distributed suite on Gloo and on loom at one world size and compares:
loom must pass every test Gloo passes, except those in exceptions.txt.

    python compare.py --world-size 4                 # both backends, live (exit 1 if loom misses one)
    python compare.py --world-size 4 -k "all_reduce or broadcast"   # a part of the suite
    python compare.py --world-size 4 --write         # also record Gloo's passes in expected_ws4.txt

Ranks start by fork (TestSuiteWithFork) unless --spawn. Prints each backend's counts and every
test Gloo passes and loom does not.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def listed(path: Path) -> list[str]:
    """Test names in one of this folder's lists (first word of each line, comments skipped)."""
    names = []
    for line in path.read_text().splitlines():
        word = line.split("#", 1)[0].strip()
        if word.startswith("test_"):
            names.append(word.split()[0])
    return names


def run_suite(backend: str, world_size: int, spawn: bool, select: list[str], keyword: str | None,
              timeout: float) -> tuple[set[str], str]:
    """Runs the suite (or `select`ed tests, or `keyword`) on `backend`; returns the names that
    passed and the summary line."""
    cls = "TestSuiteWithSpawn" if spawn else "TestSuiteWithFork"
    ids = [f"run_torch_suite.py::{cls}::{name}" for name in select] or [f"run_torch_suite.py::{cls}"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *ids]
    if keyword:
        cmd += ["-k", keyword]
    # The CPU suite: on a host with fewer GPUs than ranks the suite would skip every test.
    env = {**os.environ, "BACKEND": backend, "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout)
    passed = set(re.findall(r"^PASSED \S+::(test_\w+)", done.stdout, re.M))
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    return passed, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("-k", dest="keyword", help="pytest -k expression: run a part of the suite")
    parser.add_argument("--spawn", action="store_true", help="start ranks as fresh interpreters")
    parser.add_argument("--write", action="store_true", help=f"write Gloo's passes to expected_ws<N>.txt")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()

    results = {}
    for backend in ("gloo", "loom"):
        start = time.monotonic()
        results[backend], summary = run_suite(backend, args.world_size, args.spawn, [], args.keyword, args.timeout)
        print(f"{backend:>5} at WORLD_SIZE={args.world_size}: {summary} ({time.monotonic() - start:.0f} s)",
              flush=True)
    exceptions = set(listed(HERE / "exceptions.txt"))
    missing = sorted(results["gloo"] - results["loom"] - exceptions)
    print(f"Gloo passes {len(results['gloo'])}; loom passes {len(results['loom'])}, "
          f"{len(results['gloo'] & exceptions)} of Gloo's are in exceptions.txt")
    for name in missing:
        print(f"  loom does not pass: {name}")
    if args.write:
        path = HERE / f"expected_ws{args.world_size}.txt"
        head = [line for line in path.read_text().splitlines() if line.startswith("#")] if path.exists() else []
        path.write_text("\n".join(head + sorted(results["gloo"])) + "\n")
        print(f"wrote {path}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
