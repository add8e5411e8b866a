"""`python -m loom.trace` on timelines made by hand: calls grouped by size, their parts
summed, calls through torch split around the engine's collective (a CUDA call: around its
enqueue), and two busy threads on one CPU found (the mark of a rank's threads time-sharing a
core)."""

from __future__ import annotations

import json
import subprocess
import sys

from loom.trace import BusyCpus, Span, summary


def span(name, begin, end, n=0, cpu=0, tid=1):
    return {"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": begin, "dur": end - begin,
            "args": {"n": n, "cpu": cpu}}


def test_two_threads_busy_on_one_cpu_at_once_are_found_and_apart_they_are_not():
    def busy(*spans):
        threads = {}
        for tid, begin, end, cpu in spans:
            threads.setdefault(tid, []).append(Span(begin, end, "copy", 0, cpu))
        return BusyCpus([threads])

    overlapping = busy((1, 0, 10, 3), (2, 5, 15, 3))
    assert overlapping.shared(0, 20)
    assert not overlapping.shared(11, 20)  # only thread 2 is busy there
    assert not busy((1, 0, 10, 3), (2, 10, 15, 3)).shared(0, 20)  # one after the other
    assert not busy((1, 0, 10, 3), (2, 5, 15, 4)).shared(0, 20)  # on two CPUs
    # A long span of one thread overlapping a later one of another, past a short one.
    assert busy((1, 0, 100, 0), (1, 101, 102, 0), (2, 50, 60, 0)).shared(0, 200)


def test_shared_cpu_windows_agree_with_a_scan_of_every_pair_of_spans():
    """The bisection over precomputed crowded intervals answers as checking every pair of
    different threads' spans on each CPU for an overlap inside the window does."""
    import random

    rng = random.Random(7)
    threads, flat = {}, []
    for _ in range(400):
        tid, cpu = rng.randrange(5), rng.randrange(3)
        begin = rng.uniform(0, 1000)
        end = begin + rng.choice([rng.uniform(0, 2), rng.uniform(0, 30), rng.uniform(0, 300)])
        threads.setdefault(tid, []).append(Span(begin, end, "copy", 0, cpu))
        flat.append((begin, end, tid, cpu))
    busy = BusyCpus([threads])
    # Every pair of different threads' spans on one CPU, as the time they overlap.
    overlaps = [(max(b1, b2), min(e1, e2)) for i, (b1, e1, t1, c1) in enumerate(flat)
                for b2, e2, t2, c2 in flat[i + 1:] if c1 == c2 and t1 != t2]

    def scanned(begin, end):
        return any(max(b, begin) < min(e, end) for b, e in overlaps)

    answers = []
    for _ in range(300):
        begin = rng.uniform(-50, 1050)
        end = begin + rng.choice([rng.uniform(0, 1), rng.uniform(0, 20), rng.uniform(0, 400)])
        answers.append(busy.shared(begin, end))
        assert answers[-1] == scanned(begin, end), (begin, end)
    assert 0 < sum(answers) < len(answers)  # both answers were checked


def test_summary_groups_calls_and_names_their_parts(tmp_path):
    events = []
    for i, (size, length) in enumerate([(4096, 10), (4096, 12), (1 << 20, 100), (1 << 20, 300)]):
        t = 1000.0 * i
        events += [span("c10d call", t, t + length + 3),
                   span("all_reduce", t + 1, t + 1 + length, n=size),
                   span("copy", t + 1, t + 1 + length / 2, n=size, cpu=0),
                   span("reduction", t + 1 + length / 2, t + 1 + length, n=size, cpu=0)]
    # The slow 1 MiB call had a helper part on the caller's CPU meanwhile.
    events.append(span("helper part", 3001, 3101, cpu=0, tid=2))
    (tmp_path / "run.1.json").write_text(json.dumps({"traceEvents": events}))
    done = subprocess.run([sys.executable, "-m", "loom.trace", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "all_reduce of 4096 B: 2 calls, median 11.0 µs" in out, out
    assert "all_reduce of 1048576 B: 2 calls, median 200.0 µs" in out, out
    assert "c10d call all_reduce of 1048576 B: 2 calls" in out and "before the collective 1.0" in out, out
    assert "c10d call all_reduce of 4096 B: 2 calls, median 14.0 µs, the collective 11.0" in out, out
    lines = out.splitlines()
    slower = next(line for line in lines[lines.index(next(x for x in lines if "of 1048576 B: 2 calls, median" in x
                                                           and x.startswith("  all_reduce"))):]
                  if "slower half" in line)
    assert "copy 150.0, reduction 150.0" in slower and "helpers' parts 100.0" in slower, slower
    assert "a CPU shared by two busy threads in 1 of 1" in slower, slower


def test_waits_that_fell_asleep_are_counted_and_not_added_to_the_call_twice(tmp_path):
    # Four 8-byte all_reduces of 10, 12, 100 and 300 µs; the two slow ones waited for a peer
    # and fell asleep inside that wait (the "asleep" span lies inside the "phase wait").
    events = []
    for i, (length, asleep) in enumerate([(10, 0), (12, 0), (100, 60), (300, 250)]):
        t = 1000.0 * i
        events += [span("all_reduce", t, t + length, n=8),
                   span("phase wait", t + 2, t + length - 1, n=8)]
        if asleep:
            events.append(span("asleep", t + 5, t + 5 + asleep, n=8))
    (tmp_path / "run.1.json").write_text(json.dumps({"traceEvents": events}))
    done = subprocess.run([sys.executable, "-m", "loom.trace", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    faster = next(line for line in lines if "faster half" in line)
    slower = next(line for line in lines if "slower half" in line)
    assert "a wait fell asleep in 0" in faster, faster
    assert "a wait fell asleep in 2" in slower, slower
    # The sleep is part of the phase wait: the rest of the call is 3 µs either way.
    assert "asleep 155.0" in slower and "between spans 3.0" in slower, slower


def test_ranks_that_begin_late_because_they_left_the_call_before_late_are_told_apart(tmp_path):
    """Three ranks, ten 8-byte all_reduces: rank 2's wait wakes 100 µs late in every call, so
    it leaves each call 100 µs after the others and, back 5 µs later as they are, begins
    the next 100 µs after them; they wait for it there and leave 10 µs after it arrives."""
    events = {rank: [] for rank in range(3)}
    left = 0.0  # when ranks 0 and 1 left the call before
    for _ in range(10):
        for rank in (0, 1):
            events[rank].append(span("all_reduce", left + 5, left + 115, n=8, tid=rank + 1))
        events[2].append(span("all_reduce", left + 105, left + 215, n=8, tid=3))
        left += 115
    for rank, mine in events.items():
        for e in mine:
            e["pid"] = 100 + rank
        (tmp_path / f"run.{100 + rank}.json").write_text(json.dumps({"traceEvents": mine}))
    lines = summary(tmp_path / "run")
    assert lines[-2].startswith("across 3 ranks"), lines
    assert lines[-1] == ("  across ranks, all_reduce of 8 B: 9 calls, the last began 100.0 after the first (p90 "
                         "100.0); they had left the call before 100.0 apart; the last had been "
                         "out of it 5.0"), lines[-1]


def test_ranks_whose_calls_cannot_be_matched_are_not_compared(tmp_path):
    def run(*processes):
        for old in tmp_path.glob("run.*.json"):
            old.unlink()
        for pid, events in enumerate(processes, 1):
            (tmp_path / f"run.{pid}.json").write_text(json.dumps({"traceEvents": events}))
        return summary(tmp_path / "run")[-1]

    def calls(*sizes, offset=0.0, tid=1):
        return [span("all_reduce", offset + 100.0 * i, offset + 100.0 * i + 50, n=n, tid=tid)
                for i, n in enumerate(sizes)]

    assert "differ in order" in run(calls(8, 16), calls(8, 32))
    assert "ran 2 to 3 collectives" in run(calls(8, 8), calls(8, 8, 8))
    # Two groups' calls overlapping in one process (on two threads).
    assert "overlapping collectives" in run(calls(8) + calls(8, offset=20, tid=2), calls(8, 8))
    assert "no collective on the CPU path" in run(calls(8), [span("cuda enqueue", 0, 5, tid=1)])
    # Two runs' files under one prefix: the calls match by size but never meet in time.
    assert "3 of 3 calls that every rank must meet in never overlapped" in run(
        calls(8, 8, 8), calls(8, 8, 8, offset=5e9))
    # A process's call on its collective thread (asynchronous) between two on its caller's.
    mixed = calls(8) + [span("all_reduce", 100, 150, n=8, tid=2)] + calls(8, 8, 8)[2:]
    assert run(mixed, calls(8, 8, 8)).startswith("  across ranks, all_reduce of 8 B: 2 calls")


def test_the_network_threads_time_inside_calls_is_summed_per_thread(tmp_path):
    # Two 1 MiB all_reduces across hosts; the rail thread receives and waits during both, the
    # send thread sends, and a span of each outside the calls is left out.
    events = []
    for t in (0.0, 1000.0):
        events += [span("all_reduce", t, t + 100, n=1 << 20, tid=1),
                   span("rail job", t + 10, t + 90, tid=2),
                   span("receive", t + 10, t + 90, tid=2),
                   span("wait on the network", t + 20, t + 50, tid=2),
                   span("send", t + 10, t + 80, tid=3),
                   span("wait for bytes to send", t + 30, t + 40, tid=3)]
    events += [span("send", 500, 600, tid=3), span("helper part", 10, 20, tid=4)]
    (tmp_path / "net.1.json").write_text(json.dumps({"traceEvents": events}))
    done = subprocess.run([sys.executable, "-m", "loom.trace", str(tmp_path / "net")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if "other threads" in x)
    assert "rail thread 2: rail job 80.0, receive 80.0, wait on the network 30.0" in line, line
    assert "send thread 3: send 70.0, wait for bytes to send 10.0" in line, line
    assert "helper" not in line, line


def test_cuda_calls_are_split_around_their_enqueue(tmp_path):
    # A CUDA all_reduce (c10d OpType 1): the plugin's call holds the executor's enqueue.
    events = []
    for i, length in enumerate([4.0, 6.0, 8.0]):
        t = 100.0 * i
        events += [span("c10d call", t, t + length + 3, n=1),
                   span("cuda enqueue", t + 2, t + 2 + length)]
    # An OpType this version of loom.trace does not know is shown by its number.
    events += [span("c10d call", 1000, 1010, n=99), span("cuda enqueue", 1001, 1009)]
    (tmp_path / "gpu.1.json").write_text(json.dumps({"traceEvents": events}))
    done = subprocess.run([sys.executable, "-m", "loom.trace", str(tmp_path / "gpu")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("c10d call CUDA all_reduce: 3 calls, median 9.0 µs, the enqueue 6.0"
            in done.stdout), done.stdout
    assert "before the enqueue 2.0, after it 1.0" in done.stdout, done.stdout
    assert "c10d call CUDA call of op type 99: 1 calls" in done.stdout, done.stdout


def test_each_file_is_announced_before_it_is_read_when_asked(tmp_path):
    for pid in (7, 8):
        events = [span("all_reduce", 0, 10, n=8, tid=pid)]
        (tmp_path / f"run.{pid}.json").write_text(json.dumps({"traceEvents": events}))
    seen = []
    lines = summary(tmp_path / "run", reading=lambda i, n, path: seen.append((i, n, path)))
    assert seen == [(0, 2, str(tmp_path / "run.7.json")), (1, 2, str(tmp_path / "run.8.json"))]
    assert sum("all_reduce of 8 B: 1 calls" in line for line in lines) == 2, lines


def test_no_files_is_a_clear_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "loom.trace", str(tmp_path / "nothing")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "was LOOM_TRACE=" in done.stderr, done.stderr


def test_a_file_that_is_not_a_whole_timeline_is_skipped_with_a_warning(tmp_path):
    """A timeline cut short (its process killed while writing it) or not a timeline at all is
    left out, named on stderr; the others are summarised. With none readable: a clear error."""
    (tmp_path / "run.7.json").write_text(json.dumps({"traceEvents": [span("all_reduce", 0, 10, n=8)]}))
    (tmp_path / "run.8.json").write_text('{"traceEvents":[\n{"name":"all_reduce","ph":"X","pid":8,"ts":1')
    (tmp_path / "run.9.json").write_text(json.dumps({"events": []}))
    done = subprocess.run([sys.executable, "-m", "loom.trace", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"skipping {tmp_path / 'run.8.json'}: not a whole timeline (JSONDecodeError" in done.stderr, done.stderr
    assert f"skipping {tmp_path / 'run.9.json'}: not a whole timeline (KeyError" in done.stderr, done.stderr
    assert f"{tmp_path / 'run.7.json'}:" in done.stdout and "all_reduce of 8 B: 1 calls" in done.stdout, done.stdout
    assert "run.8.json" not in done.stdout and "run.9.json" not in done.stdout, done.stdout
    (tmp_path / "run.7.json").write_text("")
    done = subprocess.run([sys.executable, "-m", "loom.trace", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "none of the 3 files" in done.stderr, done.stderr
