"""Running scripts under torchrun for the framework tests, and reading what they report."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# What every framework run gets: one thread per rank (2 ranks share the 2 cores of CI), no
# downloads, DeepSpeed on its CPU accelerator, and no GPU: these are CPU runs, and on a host
# with GPUs the frameworks would otherwise prepare GPU runs.
ENV = {
    "CUDA_VISIBLE_DEVICES": "",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DS_ACCELERATOR": "cpu",
    "PYTHONWARNINGS": "ignore",
}


def require(*modules: str) -> None:
    """Skips the calling test when a framework is not installed, unless the run must have them
    all (LOOM_REQUIRE_FRAMEWORKS=1, as scripts/test.sh sets it): then that is a failure."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    message = f"not installed: {', '.join(missing)} (bash scripts/setup_frameworks.sh installs them)"
    if os.environ.get("LOOM_REQUIRE_FRAMEWORKS") == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def launch(script: Path, args: list[str], cwd: Path, ranks: int = 2, env: dict | None = None,
           timeout: float = 600) -> tuple[subprocess.CompletedProcess, str]:
    """Runs `script` on `ranks` local ranks under torchrun; returns the outcome and the command."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", str(script), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **ENV, **(env or {})})
    return done, " ".join(cmd)


def failure(done: subprocess.CompletedProcess, cmd: str) -> str:
    return f"{cmd} failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"


def torchrun(script: Path, args: list[str], cwd: Path, ranks: int = 2, env: dict | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """Runs `script` on `ranks` local ranks under torchrun; fails the test if it fails."""
    done, cmd = launch(script, args, cwd, ranks, env, timeout)
    assert done.returncode == 0, failure(done, cmd)
    return done


def gloo_died_after_reporting(backend: str, stderr: str, report: Path, ranks: int) -> bool:
    """Whether a failed run was a Gloo reference that trained, reported on every rank and then
    died at interpreter exit. torch can abort a Gloo process there ("terminate called without
    an active exception"; seen in about 1 of 100 Gloo runs on the 2-core CI machine, and twice
    in a row once): a ProcessGroupGloo worker thread drops the last reference to a finished
    work's tensors while the interpreter finalises, and acquiring the GIL then ends the thread
    inside a noexcept frame (pytorch/pytorch#179291 describes that abort). The peers of the
    aborted process may then die of the torn-down job too. Every rank's report is complete by
    then (examples/report.py writes it aside and renames it), so such a reference run is used
    as it is: it is only the reference, and running it again can abort the same way."""
    crashed = "SIGABRT" in stderr or "terminated with signal" in stderr or "terminate called" in stderr
    return backend == "gloo" and crashed and len(list(report.glob("rank*.json"))) == ranks


def run_example(script: str, backend: str, extra: list[str], directory: Path, steps: int = 5) -> list[dict]:
    """Runs examples/<script> with --backend and --report; returns every rank's report."""
    report = directory / f"report-{backend}"
    args = ["--steps", str(steps), "--backend", backend, "--report", str(report), *extra]
    done, cmd = launch(EXAMPLES / script, args, cwd=directory)
    if done.returncode != 0 and gloo_died_after_reporting(backend, done.stderr, report, 2):
        warnings.warn(f"the Gloo reference run aborted at exit after reporting:\n{done.stderr[-1500:]}")
    else:
        assert done.returncode == 0, failure(done, cmd)
    ranks = sorted(report.glob("rank*.json"))
    assert [p.name for p in ranks] == ["rank0.json", "rank1.json"], ranks
    return [json.loads(p.read_text()) for p in ranks]


def assert_same_training(label: str, on_loom: list[dict], on_gloo: list[dict], needed: set[str]) -> None:
    """The reports of one script run on loom and on Gloo: every rank's losses agree within 1e-5
    relative, loom's flight record shows the operations in `needed`, the Gloo run used none of
    loom, and in each run every rank ended with the same weights."""
    for loom_rank, gloo_rank in zip(on_loom, on_gloo, strict=True):
        rank = loom_rank["rank"]
        assert len(loom_rank["losses"]) == len(gloo_rank["losses"]) > 0
        for step, (got, want) in enumerate(zip(loom_rank["losses"], gloo_rank["losses"])):
            assert math.isclose(got, want, rel_tol=1e-5), (
                f"{label}, rank {rank}, step {step}: loss {got} on loom, {want} on Gloo")
        ran = set(loom_rank["loom_ops"])
        assert needed <= ran, f"{label}, rank {rank}: loom ran {loom_rank['loom_ops']}, not all of {needed}"
        assert gloo_rank["loom_ops"] == {}, f"{label}: the Gloo run used loom: {gloo_rank['loom_ops']}"
    for run, name in ((on_loom, "loom"), (on_gloo, "Gloo")):
        digests = {r["weights"] for r in run}
        assert len(digests) == 1, f"{label} on {name}: the ranks ended with different weights"
