"""The examples run under torchrun, unchanged, and their loss goes down (they exit non-zero
otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp2.py"])
def test_example_trains_under_torchrun(script, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", str(EXAMPLES / script), "--steps", "20"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "->" in done.stdout, done.stdout
