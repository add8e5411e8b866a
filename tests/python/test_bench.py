"""`python -m loom.bench`, the README's first command, run as a user runs it: the installed
package from a directory outside the checkout, with torch's deprecation warnings as errors (so
it keeps to the API torch 2.13 recommends), writing its table, JSON and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from loom import _netns
from loom.bench import OPS, merge_sweeps, steadiness


def test_bench_runs_outside_the_checkout_without_deprecated_api(tmp_path):
    cmd = [sys.executable, "-W", "error::FutureWarning", "-W", "error::DeprecationWarning", "-m", "loom.bench",
           "--ranks", "2", "--max-bytes", "4K", "--repeats", "2", "--quiet", "--out", "out"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {row["op"] for row in results["results"]} == set(OPS)
    for row in results["results"]:
        assert row["loom"] > 0 and row["gloo"] > 0, row
    assert (tmp_path / "out" / "table.txt").read_text().count("gloo/loom") == len(OPS)
    assert "OMP_WAIT_POLICY: unset" in (tmp_path / "out" / "table.txt").read_text()
    assert results["omp_wait_policy"] == "" and results["torch_threads"] >= 1
    assert (tmp_path / "out" / "busbw.png").stat().st_size > 0
    for row in results["results"]:
        assert row["loom_p90"] >= row["loom"] and row["gloo_p90"] >= row["gloo"], row
        assert len(row["loom_sweeps"]) == 2 and min(row["loom_sweeps"]) <= row["loom"] <= max(row["loom_sweeps"])
    table = (tmp_path / "out" / "table.txt").read_text()
    assert "## steadiness" in table and "loom: the 2 sweeps' medians agree within 25% at " in table


def test_bench_times_send_recv_when_asked(tmp_path):
    """--ops send_recv: pairs of ranks exchanging with batch_isend_irecv (an odd last rank
    idles), loom and Gloo side by side; the direct entry has no send/recv, so asking for it
    with send_recv is refused by name."""
    cmd = [sys.executable, "-m", "loom.bench", "--ranks", "3", "--max-bytes", "1K", "--ops", "send_recv",
           "--quiet", "--out", "out"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [row["bytes"] for row in results["results"]] == [8, 16, 32, 64, 128, 256, 512, 1024]
    for row in results["results"]:
        assert row["op"] == "send_recv" and row["loom"] > 0 and row["gloo"] > 0, row
    refused = subprocess.run([sys.executable, "-m", "loom.bench", "--ops", "send_recv", "--backends", "loom,direct"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "send_recv is timed through torch.distributed only" in refused.stderr


def test_steadiness_names_the_points_whose_sweeps_disagree_and_the_cliffs():
    """The report behind the CPU issue's bars: sweeps that disagree by more than 25%, and a
    median over 1.2x the next larger size's, each named with its numbers."""
    def sweep(times):
        return [{"op": "all_reduce", "bytes": b, "ranks": 2, "loom": t, "loom_p90": 2 * t}
                for b, t in zip((8, 16, 32), times)]
    rows = merge_sweeps([sweep([10e-6, 30e-6, 20e-6]), sweep([11e-6, 31e-6, 20e-6]),
                         sweep([30e-6, 29e-6, 21e-6])], ["loom"])
    assert [r["loom"] for r in rows] == [11e-6, 30e-6, 20e-6]
    assert rows[0]["loom_sweeps"] == [10e-6, 11e-6, 30e-6] and rows[0]["loom_p90"] == 22e-6
    agree, cliffs = steadiness(rows, ["loom"])
    assert agree.startswith("loom: the 3 sweeps' medians agree within 25% at 2 of 3 points; not at "
                            "all_reduce 8 B (10.0, 11.0, 30.0 us)")
    assert cliffs == ("loom: 1 cliff (a median over 1.2x the next larger size's): "
                      "all_reduce 16 B (30.0 us against 20.0 at 32 B)")
    (one,) = steadiness(merge_sweeps([sweep([10e-6, 11e-6, 12e-6])], ["loom"]), ["loom"])
    assert one == "loom: no cliffs (no median over 1.2x the next larger size's)"


def test_bench_runs_under_torchrun(tmp_path):
    """Launched by torchrun (as on several machines), rank 0 reports for the job, DDP steps at
    two batch sizes included."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", "-m", "loom.bench", "--max-bytes", "1K", "--ops", "all_reduce",
           "--ddp-step", "--ddp-params", "1", "--ddp-steps", "3", "--ddp-batch", "4,1", "--quiet", "--out", "out"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["ranks"] == 2 and results["hosts"] == 1
    assert [row["bytes"] for row in results["results"]] == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert list(results["ddp"]) == ["4", "1"]
    for times in results["ddp"].values():
        assert set(times) == {"loom", "gloo"}
        assert all(0 < t["median"] <= t["p90"] for t in times.values()), times
    table = (tmp_path / "out" / "table.txt").read_text()
    assert "batch 1 per rank" in table and table.count("\ngloo/loom: ") == 2


def test_bench_across_namespace_hosts_with_shaped_links(tmp_path):
    """--hosts places the ranks on namespace hosts (root only, like tests/net), and the table
    gives each host's link rate."""
    reason = _netns.unavailable_reason()
    if reason:
        if os.environ.get("LOOM_REQUIRE_NETNS") == "1":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    cmd = [sys.executable, "-m", "loom.bench", "--ranks", "4", "--hosts", "2", "--link-gbit", "1",
           "--min-bytes", "4M", "--max-bytes", "4M", "--ops", "all_reduce,all_gather_into_tensor", "--quiet",
           "--out", "out"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["hosts"] == 2 and results["link_gbit"] == 1
    table = (tmp_path / "out" / "table.txt").read_text()
    assert "on 2 hosts" in table and "host GB/s" in table
    # An all_reduce of 4 MiB sends 4 MiB from each host: over 1 Gb/s that takes 34 ms (less
    # what the token bucket lets through at once, 250 KB): the shaping is in force.
    reduced = next(r for r in results["results"] if r["op"] == "all_reduce")
    assert reduced["bytes"] == 4 << 20 and reduced["loom"] > 0.025, reduced


def test_traced_bench_leaves_every_ranks_timeline_and_the_summary_reads_it(tmp_path):
    """--trace (LOOM_TRACE through torch): the ranks are multiprocessing children, which
    leave through os._exit (no atexit), so each communicator's end must write the timeline;
    the bench then writes `python -m loom.trace`'s summary, calls grouped by size with where
    their time went, and the same summary comes from the command."""
    cmd = [sys.executable, "-m", "loom.bench", "--ranks", "2", "--min-bytes", "1M", "--max-bytes", "1M",
           "--ops", "all_reduce", "--backends", "loom", "--quiet", "--out", "out", "--trace"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted((tmp_path / "out" / "trace").glob("rank.*.json"))
    assert len(files) == 2, files  # one per rank process
    for f in files:
        names = {e["name"] for e in json.loads(f.read_text())["traceEvents"]}
        assert {"all_reduce", "copy", "reduction", "phase wait", "c10d call"} <= names, names
    written = (tmp_path / "out" / "trace.txt").read_text()
    lines = written.splitlines()
    # Each rank's 1 MiB all_reduce calls in the engine, with their copies, and the same calls
    # as c10d calls around them.
    assert sum(line.startswith("  all_reduce of 1048576 B:") for line in lines) == 2, written
    assert sum(line.startswith("  c10d call all_reduce of 1048576 B:") for line in lines) == 2, written
    # Then the two ranks' calls side by side: how far apart they began each one.
    assert sum(line.startswith("  across ranks, all_reduce of 1048576 B:") for line in lines) == 1, written
    assert written.count("faster half") >= 2 and "copy" in written, written
    summary = subprocess.run([sys.executable, "-m", "loom.trace", str(tmp_path / "out" / "trace" / "rank")],
                             capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0 and summary.stdout == written, summary.stderr


def test_ddp_embedding_model_is_a_table_of_the_asked_size_under_one_layer():
    from loom.bench import ddp_model

    model, make_input = ddp_model("embedding", 0.5, 64)
    table, layer = model[0], model[1]
    assert table.num_embeddings == round(0.5e6 / 64) and table.embedding_dim == 64
    assert tuple(layer.weight.shape) == (64, 64)
    x = make_input(7)
    assert x.shape == (7,) and int(x.min()) >= 0 and int(x.max()) < table.num_embeddings
    assert tuple(model(x).shape) == (7, 64)
    mlp, make_mlp_input = ddp_model("mlp", 0.5, 256)
    assert tuple(mlp(make_mlp_input(3)).shape) == (3, 256)


def test_ddp_step_with_bucket_view_runs_on_both_backends(tmp_path):
    cmd = [sys.executable, "-m", "loom.bench", "--ranks", "2", "--ops", "all_reduce", "--max-bytes", "8",
           "--ddp-step", "--ddp-model", "embedding", "--ddp-params", "0.5", "--ddp-width", "64",
           "--ddp-batch", "4", "--ddp-steps", "2", "--ddp-bucket-view", "--quiet", "--out", "out"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = (tmp_path / "out" / "table.txt").read_text()
    assert "embedding table and one layer" in table and "gradient_as_bucket_view" in table
    ddp = json.loads((tmp_path / "out" / "results.json").read_text())["ddp"]["4"]
    assert ddp["loom"]["median"] > 0 and ddp["gloo"]["median"] > 0


def test_a_rank_that_dies_is_reported_and_the_bench_ends(tmp_path):
    """A rank killed mid-run (SIGKILL: it never reports) fails the run with both ranks'
    stories within seconds; the bench does not wait for its report forever."""
    import signal
    import time

    cmd = [sys.executable, "-m", "loom.bench", "--ranks", "2", "--min-bytes", "1M", "--max-bytes", "64M",
           "--backends", "loom", "--repeats", "20", "--quiet", "--out", "out"]
    bench = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    children: list[int] = []
    deadline = time.monotonic() + 120
    while len(children) < 2 and time.monotonic() < deadline:  # the forked ranks
        time.sleep(0.2)
        children = sorted(int(d) for d in os.listdir("/proc") if d.isdigit()
                          and _parent_of(int(d)) == bench.pid)
    time.sleep(2)  # inside the sweep
    os.kill(children[-1], signal.SIGKILL)
    out, _ = bench.communicate(timeout=120)
    assert bench.returncode != 0, out[-2000:]
    assert "exited with code -9 before reporting" in out, out[-2000:]
    assert "exited without leaving the communicator" in out, out[-2000:]


def _parent_of(pid: int) -> int:
    """The parent pid of `pid`, or -1 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def test_sizes_from_zero_are_refused():
    done = subprocess.run([sys.executable, "-m", "loom.bench", "--min-bytes", "0"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "1 <= --min-bytes <= --max-bytes" in done.stderr, done.stderr


def _refusal(main, argv: list[str], capsys) -> str:
    """What `main(argv)` says on stderr as it refuses its arguments (exit status 2)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_bench_refuses_arguments_that_leave_nothing_to_time(capsys):
    """Training steps with neither loom nor Gloo among the backends, and lists that name
    nothing, are refused before any rank starts, by name."""
    from loom.bench import main

    for step in ("--ddp-step", "--fsdp-step"):
        err = _refusal(main, ["--backends", "direct,fake", step], capsys)
        assert f"{step}: the training steps run on the loom and Gloo groups only; add loom or gloo" in err, err
    assert "--ops names no op" in _refusal(main, ["--ops", ","], capsys)
    assert "--backends names no backend" in _refusal(main, ["--backends", ","], capsys)


def test_bench_refuses_values_it_cannot_run_by_name(capsys):
    """Values that crashed every rank after the sweep (no steps to take a median of, a
    negative thread count) or shaped a link to nothing (tc rate 0, NaN, or a negative rate
    left unlimited but recorded) are refused before any rank starts."""
    from loom.bench import main

    for flag, step in (("--ddp-steps", "--ddp-step"), ("--fsdp-steps", "--fsdp-step")):
        assert f"{flag} must be at least 1" in _refusal(main, [step, flag, "0"], capsys)
    assert "--threads must be at least 1" in _refusal(main, ["--threads", "-1"], capsys)
    for rate in ("-1", "nan", "1e-9", "inf"):
        err = _refusal(main, ["--ranks", "2", "--hosts", "2", "--link-gbit", rate], capsys)
        assert "--link-gbit must be 0 (no limit) or at least 0.001 Gb/s" in err, (rate, err)


def test_tensor_store_bench_refuses_counts_below_one(capsys):
    from loom.tensor_store.bench import main

    for flag in ("--steps", "--tensors", "--generators"):
        assert f"{flag} must be at least 1 (got 0)" in _refusal(main, [flag, "0"], capsys)


def test_tensor_store_bench_refuses_sizes_it_cannot_read(capsys):
    """`--bytes` of the tensor store's benchmark reads sizes as loom.bench does: text that
    is no size is a usage error, never a traceback."""
    from loom.tensor_store.bench import main as store_main

    for text in ("B", "", "64KiB", "1.5X"):
        assert "is not a size like" in _refusal(store_main, ["--bytes", text], capsys), text


def test_benches_refuse_to_call_loom_gloo(capsys, monkeypatch):
    """With LOOM_REPLACES_GLOO on, a group asked for as "gloo" runs on loom: the benches'
    Gloo rows would time loom under Gloo's name, so they refuse until it is off."""
    from loom import _backend_names
    from loom.bench import main
    from loom.tensor_store.bench import main as store_main

    monkeypatch.setattr(_backend_names, "_replaces_gloo", True)
    assert "LOOM_REPLACES_GLOO is set" in _refusal(main, ["--backends", "loom,gloo"], capsys)
    assert "LOOM_REPLACES_GLOO is set" in _refusal(store_main, [], capsys)


def test_p90_is_the_nearest_rank_percentile_that_loom_bench_reports():
    # The smallest value that at least 90% of the values do not exceed (loom-bench's
    # percentile90); it once took the next one up (the 37th of 40 calls, the largest of 10).
    from loom._stats import p90

    for n, want in {1: 1, 9: 9, 10: 9, 11: 10, 15: 14, 20: 18, 40: 36}.items():
        assert p90(list(range(1, n + 1))) == want, n
