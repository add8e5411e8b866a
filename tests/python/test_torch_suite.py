"""PyTorch's own backend-generic distributed suite (torch.testing._internal.distributed.
distributed_test) with BACKEND=loom: loom passes everything Gloo passes on CPU, except the
few tests listed in torch_suite/expected.txt that no third-party backend can pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "torch_suite"


def expected_tests() -> list[str]:
    names = []
    for line in (HERE / "expected.txt").read_text().splitlines():
        line = line.strip()
        if line.startswith("test_"):
            names.append(line.split()[0])
    return names


@pytest.mark.skipif(os.environ.get("LOOM_SKIP_TORCH_SUITE") == "1", reason="LOOM_SKIP_TORCH_SUITE=1")
def test_loom_passes_what_gloo_passes(tmp_path):
    pytest.importorskip("expecttest", reason="torch's test utilities need expecttest (pip install expecttest)")
    names = expected_tests()
    ids = [f"run_torch_suite.py::TestLoomWithSpawn::{n}" for n in names]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *ids]
    env = {**os.environ, "BACKEND": "loom", "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=1800)
    tail = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert f"{len(names)} passed" in done.stdout, tail
