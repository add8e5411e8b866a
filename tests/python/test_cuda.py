"""loom's CUDA path through torch.distributed. It needs an NVIDIA GPU: on a machine without
one (the CI machine) this is skipped with the reason, and scripts/cuda_check.sh runs the
full suite on a GPU host (results in docs/perf/cuda_check_*.txt)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA GPU here: the CUDA path is tested on a GPU host with scripts/cuda_check.sh",
)


def test_every_collective_with_two_ranks_sharing_the_gpu():
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "cuda" / "check_cuda.py"), "--ranks", "2"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
