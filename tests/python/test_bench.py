"""`python -m loom.bench`, the README's first command, run as a user runs it: the installed
package from a directory outside the checkout, with torch's deprecation warnings as errors (so
it keeps to the API torch 2.13 recommends), writing its table, JSON and plot."""

from __future__ import annotations

import json
import subprocess
import sys

from loom.bench import OPS


def test_bench_runs_outside_the_checkout_without_deprecated_api(tmp_path):
    cmd = [sys.executable, "-W", "error::FutureWarning", "-W", "error::DeprecationWarning", "-m", "loom.bench",
           "--ranks", "2", "--max-bytes", "4K", "--quiet", "--out", "out"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {row["op"] for row in results["results"]} == set(OPS)
    for row in results["results"]:
        assert row["loom"] > 0 and row["gloo"] > 0, row
    assert (tmp_path / "out" / "table.txt").read_text().count("gloo/loom") == len(OPS)
    assert (tmp_path / "out" / "busbw.png").stat().st_size > 0
