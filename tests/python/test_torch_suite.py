"""PyTorch's own backend-generic distributed suite (torch.testing._internal.distributed.
distributed_test) with BACKEND=loom, at world sizes 2 and 4: loom passes every test Gloo passes
on CPU (torch_suite/expected_ws<N>.txt, measured with torch_suite/compare.py), except the few
in torch_suite/exceptions.txt that no third-party backend can pass."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "torch_suite"))
from compare import HERE, listed, run_suite  # noqa: E402


@pytest.mark.skipif(os.environ.get("LOOM_SKIP_TORCH_SUITE") == "1", reason="LOOM_SKIP_TORCH_SUITE=1")
@pytest.mark.parametrize("world_size", [2, 4])
def test_loom_passes_what_gloo_passes(world_size):
    pytest.importorskip("expecttest", reason="torch's test utilities need expecttest (pip install expecttest)")
    names = sorted(set(listed(HERE / f"expected_ws{world_size}.txt")) - set(listed(HERE / "exceptions.txt")))
    passed, summary = run_suite("loom", world_size, spawn=False, select=names, keyword=None, timeout=1800)
    missing = sorted(set(names) - passed)
    assert not missing, f"loom at WORLD_SIZE={world_size} does not pass: {missing}\n{summary}"
