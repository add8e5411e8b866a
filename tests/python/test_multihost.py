"""torchrun --nnodes 2 across two hosts made of network namespaces on this machine (one
bridge, a veth per host, all removed afterwards): DDP and FSDP2 train on loom exactly as on
Gloo in the same layout, unchanged scripts, and loom carried the collectives. Needs root and
iproute2: skipped otherwise, a failure under LOOM_REQUIRE_NETNS=1 (scripts/test.sh as root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from frameworks import ENV, EXAMPLES, assert_same_training, gloo_died_after_reporting
from harness import namespace_hosts


@pytest.fixture
def hosts():
    """Two hosts: namespaces loom<pid>py<h> with eth0 = 10.78.0.<h+1>/24 on a bridge in a hub."""
    with namespace_hosts(2, "10.78.0") as made:
        yield made.names


def start_two_nodes(hosts: list[str], script: str, backend: str, report: Path, cwd: Path) -> list[tuple]:
    """Starts examples/<script> under torchrun, 2 nodes x 2 ranks, one node per host."""
    env = {**os.environ, **ENV, "GLOO_SOCKET_IFNAME": "eth0", "LOOM_NET_IFNAME": "eth0"}
    nodes = []
    for node, name in enumerate(hosts):
        cmd = ["ip", "netns", "exec", name, sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
               "--master-addr", "10.78.0.1", "--master-port", "29400",
               str(EXAMPLES / script), "--steps", "4", "--backend", backend, "--report", str(report)]
        nodes.append((subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True), cmd))
    return nodes


def finish_two_nodes(nodes: list[tuple]) -> list[tuple[int, str, str, list[str]]]:
    """Waits for both nodes; returns each one's exit code, output, errors and command."""
    outcomes = []
    for process, cmd in nodes:
        try:
            out, err = process.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for p, _ in nodes:
                p.kill()
            raise
        outcomes.append((process.returncode, out, err, cmd))
    return outcomes


def run_on_two_nodes(hosts: list[str], script: str, backend: str, directory: Path) -> list[dict]:
    """Runs examples/<script> on two hosts; returns the four ranks' reports."""
    report = directory / f"report-{backend}"
    outcomes = finish_two_nodes(start_two_nodes(hosts, script, backend, report, directory))
    errors = "".join(err for _, _, err, _ in outcomes)
    if any(code != 0 for code, *_ in outcomes) and gloo_died_after_reporting(backend, errors, report, 4):
        warnings.warn(f"the Gloo reference run aborted at exit after reporting:\n{errors[-1500:]}")
    else:
        for code, out, err, cmd in outcomes:
            assert code == 0, f"{' '.join(cmd)} failed:\n{out[-3000:]}\n{err[-6000:]}"
    ranks = sorted(report.glob("rank*.json"))
    assert [p.name for p in ranks] == [f"rank{r}.json" for r in range(4)], ranks
    return [json.loads(p.read_text()) for p in ranks]


@pytest.mark.parametrize("script,needed", [("train_ddp.py", {"all_reduce"}),
                                           ("train_fsdp2.py", {"all_gather", "reduce_scatter"})])
def test_torchrun_two_nodes_matches_gloo(hosts, script, needed, tmp_path):
    on_loom = run_on_two_nodes(hosts, script, "loom", tmp_path)
    on_gloo = run_on_two_nodes(hosts, script, "gloo", tmp_path)
    assert_same_training(script, on_loom, on_gloo, needed)
