"""The hint loom logs when several ranks share a machine while torch's OpenMP threads spin
(python/loom/_openmp_hint.py): once per machine, and not when the user chose a wait policy."""

from __future__ import annotations

from pathlib import Path

from frameworks import failure, launch

PROBE = """
import torch
import torch.distributed as dist

import loom  # noqa: F401

torch.set_num_threads(2)
dist.init_process_group("loom")
dist.new_group()  # a second group: still one hint
dist.barrier()
dist.destroy_process_group()
"""

HINT = "start the ranks with OMP_WAIT_POLICY=PASSIVE"


def run_probe(tmp_path: Path, env: dict | None = None) -> str:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done, cmd = launch(script, [], cwd=tmp_path, env=env)
    assert done.returncode == 0, failure(done, cmd)
    return done.stderr


def test_two_ranks_with_spinning_openmp_threads_get_one_hint(tmp_path):
    stderr = run_probe(tmp_path)
    assert stderr.count(HINT) == 1, stderr[-3000:]
    assert "2 ranks share this machine and torch runs 2 OpenMP threads" in stderr


def test_a_chosen_wait_policy_silences_the_hint(tmp_path):
    for policy in ("PASSIVE", "ACTIVE"):
        assert HINT not in run_probe(tmp_path, {"OMP_WAIT_POLICY": policy})
