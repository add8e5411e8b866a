"""Failures through torch: a rank killed with SIGKILL fails its peers' collectives with a
DistBackendError naming it; the survivors rebuild with dist.shrink_group and carry on;
torchrun's elastic restart brings the whole job back; desync debug names both shapes; the
flight record and the progress report say what each rank was doing; nothing of loom's is
left in /dev/shm."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import loom
from harness import loom_names_in_dev_shm, run_ranks

HERE = Path(__file__).resolve().parent


def _first_call_then_death(rank: int, world: int, victim: int) -> str:
    """One all_reduce, then `victim` dies (once every rank has left that call: a death before
    could fail a peer's first call); the survivors' next calls fail, and this returns why."""
    x = torch.ones(8)
    dist.all_reduce(x)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"first call done {rank}", "1")
    if rank == victim:
        store.wait([f"first call done {r}" for r in range(world)])
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(3):
            dist.all_reduce(x)
    except dist.DistBackendError as e:
        return str(e)
    raise AssertionError(f"all_reduce succeeded with rank {victim} dead")


def body_kill_then_shrink(rank: int, world: int):
    message = _first_call_then_death(rank, world, 2)
    assert "rank 2" in message and "exited" in message, message
    # What every rank was doing: rank 2 is marked dead.
    assert "DEAD" in loom.progress_report(), loom.progress_report()
    failed = [r for r in loom.flight_record() if r["state"] == "failed"]
    assert failed and "rank 2" in failed[-1]["error"], failed
    # The survivors rebuild without rank 2 and get right answers.
    dist.shrink_group([2])
    assert dist.get_world_size() == world - 1
    y = torch.full((8,), float(dist.get_rank() + 1))
    dist.all_reduce(y)
    assert torch.equal(y, torch.full((8,), float(sum(range(1, world))))), y
    # Its errors give each of its ranks' global rank (they gave none where the world shrank).
    try:
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(2))
        else:
            dist.broadcast(torch.ones(2), 0)
    except dist.DistBackendError as e:
        assert "its ranks 0 to 2 are global ranks 0, 1, 3" in str(e), str(e)
    else:
        raise AssertionError("mismatched collectives succeeded")
    return message


def body_child_of_an_aborted_parent(rank: int, world: int, how: str):
    """Rank 0 makes a child of a group that rank 1 aborts instead of joining it: rank 0's
    creation fails at once with the abort, not at the creation's timeout without it."""
    store = dist.distributed_c10d._get_default_store()
    parent = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    dist.all_reduce(torch.ones(1), group=parent)
    if rank == 1:
        time.sleep(0.5)
        (parent if how == "split" else dist.group.WORLD).abort()
        store.wait([f"child of an aborted parent {how}"])
        return None
    try:
        if how == "split":
            parent.split_group([0, 1], timeout=timedelta(seconds=60), group_name="late")
        else:
            dist.new_group([0, 1], timeout=timedelta(seconds=60))
        message = "made"
    except RuntimeError as e:
        message = str(e).splitlines()[0]
    store.set(f"child of an aborted parent {how}", "1")
    return message


@pytest.mark.parametrize("how", ["split", "new_group"])
def test_a_child_whose_parent_is_aborted_meanwhile_fails_with_the_abort(how):
    # Before, it waited out its timeout and was told only that rank 1 never connected.
    message, _ = run_ranks(2, body_child_of_an_aborted_parent, how, finalize=False)
    assert "rank 1 aborted communicator" in message, message


def body_refused_shrink_with_abort(rank: int, world: int):
    """The backend's shrink with SHRINK_ABORT and a rank it cannot exclude: refused, and the
    group still works (it used to be aborted before the arguments were checked)."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    messages = []
    for bad in ([5], [rank]):
        with pytest.raises(RuntimeError) as refused:
            backend.shrink(bad, 1, None)  # 1: torch.distributed.SHRINK_ABORT
        messages.append(str(refused.value).splitlines()[0])
    x = torch.ones(4)
    dist.all_reduce(x)
    return messages, x.tolist()


def test_a_refused_shrink_with_abort_leaves_the_group_working():
    for messages, total in run_ranks(2, body_refused_shrink_with_abort):
        assert "outside [0, 2)" in messages[0] and "is in 'excluded'" in messages[1], messages
        assert total == [2.0] * 4


@pytest.mark.skipif(not hasattr(dist, "shrink_group"), reason="this torch has no shrink_group")
def test_killed_rank_fails_peers_then_survivors_shrink():
    shm_before = loom_names_in_dev_shm()
    results = run_ranks(4, body_kill_then_shrink, killed=(2,), finalize=False)
    assert results[2] == "killed"
    for message in results[:2] + results[3:]:
        assert "rank 2" in message
    assert loom_names_in_dev_shm() == shm_before


def body_group_after_a_death(rank: int, world: int):
    """World rank 1 dies; rank 2 then makes a group of global ranks 1 and 2. The error is the
    world's failure in the world's numbering, so it carries no legend of the new group's
    (which would turn its "rank 1" into global rank 2, the rank reporting it)."""
    _first_call_then_death(rank, world, 1)
    try:
        dist.new_group([1, 2])
    except dist.DistBackendError as e:
        return str(e)
    return "made"


def test_a_group_made_after_a_death_names_it_in_the_worlds_numbering():
    results = run_ranks(3, body_group_after_a_death, killed=(1,), finalize=False)
    assert results[0] == "made", results[0]  # not a member: torch makes nothing there
    assert "rank 1 (pid" in results[2] and "global ranks" not in results[2], results[2]


def body_survivors_make_a_group(rank: int, world: int):
    """World rank 2 dies; ranks 0 and 1 then make a group of themselves and use it, as Gloo's
    new_group lets them (loom refused every group derived from a failed world)."""
    _first_call_then_death(rank, world, 2)
    pair = dist.new_group([0, 1])
    x = torch.full((4,), rank + 1.0)
    dist.all_reduce(x, group=pair)
    return x.tolist()


def test_the_survivors_of_a_death_make_a_group_of_themselves():
    results = run_ranks(3, body_survivors_make_a_group, killed=(2,), finalize=False)
    assert results[:2] == [[3.0] * 4] * 2, results


def test_elastic_restart_under_torchrun(tmp_path):
    shm_before = loom_names_in_dev_shm()
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
           "--max-restarts", "1", "--monitor-interval", "0.2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "127.0.0.1:0", str(HERE / "elastic_worker.py"), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result == {"attempt": 1, "world": 3, "x": [243.0] * 4}, result
    assert loom_names_in_dev_shm() == shm_before


def body_shapes(rank: int, world: int):
    x = torch.ones(4, 8) if rank == 0 else torch.ones(8, 4)
    try:
        dist.all_reduce(x)
    except dist.DistBackendError as e:
        return str(e)
    return "passed"


def test_desync_debug_names_both_shapes():
    results = run_ranks(2, body_shapes, env={"LOOM_DESYNC_DEBUG": "1"}, finalize=False)
    for message in results:
        assert "shapes [4, 8]" in message and "shapes [8, 4]" in message, message
    # Without the debug switch the same numel is all loom needs.
    assert run_ranks(2, body_shapes) == ["passed", "passed"]


def body_flight_record(rank: int, world: int):
    t = torch.ones(16)
    dist.all_reduce(t)
    dist.broadcast(t, src=1)
    records = [r for r in loom.flight_record() if r["operation"] in ("all_reduce", "broadcast")]
    assert [r["operation"] for r in records[-2:]] == ["all_reduce", "broadcast"], records
    assert records[-2]["arguments"] == "count 16, float32, SUM", records[-2]
    assert all(r["state"] == "completed" for r in records[-2:]), records
    assert "broadcast #" in loom.progress_report()
    assert "all_reduce" in loom.format_flight_record()
    gloo = dist.new_group(backend="gloo")
    try:
        loom.progress_report(gloo)
        raise AssertionError("a Gloo group's progress report")
    except ValueError as e:
        assert "not loom's; pass a group made with backend='loom'" in str(e), e
    # A rank outside a group holds torch's token for it, not a group.
    only_rank_0 = dist.new_group([0])
    if rank == 1:
        try:
            loom.progress_report(only_rank_0)
            raise AssertionError("a progress report of a group this rank is not in")
        except ValueError as e:
            assert "rank 1): this rank is not a member of the group" in str(e), e
    else:
        assert "rank" in loom.progress_report(only_rank_0)


def test_flight_record_and_progress_report():
    run_ranks(2, body_flight_record)


def body_forked_child(rank: int, world: int):
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 0:
        pid = os.fork()
        if pid == 0:  # the child: its parent's group refuses it, and tearing it down is harmless
            code = 0
            try:
                dist.all_reduce(torch.ones(4))
                code = 2
            except Exception as e:  # noqa: BLE001
                code = 0 if "is a fork of it" in str(e) else 3
            try:
                dist.destroy_process_group()
                gc.collect()
            except Exception:  # noqa: BLE001
                code = 4
            os._exit(code)  # not through the harness, which would report as rank 0
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
    dist.barrier()
    y = torch.full((4,), float(rank + 1))
    dist.all_reduce(y)
    assert torch.equal(y, torch.full((4,), 3.0)), y


def test_a_forked_child_leaves_its_parents_group_alone():
    """A process forked from a rank (a helper that daemonises, os.fork) cannot use the rank's
    group, and its teardown of it neither hangs nor ends the group for the rank's peers."""
    run_ranks(2, body_forked_child, timeout=120)


# Anonymous mappings the 30 cycles may add without a leak: malloc can keep a chunk it mapped
# for a large allocation, or an arena it grew (seen: one 1 MiB mapping in 3 of 12 runs of this
# test alone, at this session's start too). A leak per group would add 30.
ALLOCATOR_SLACK = 2


def _footprint() -> tuple[int, int, int, int]:
    """This process's threads, open fds, file-backed memory mappings (loom's segments are
    memfds) and anonymous ones (but the malloc heap's: its break can first move, or split
    the heap in two, on a loaded host: not loom's to leak)."""
    files = anonymous = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6:
                files += fields[5] != "[heap]" and not fields[5].startswith("[")
                anonymous += fields[5].startswith("[") and fields[5] != "[heap]"
            else:
                anonymous += 1
    return (len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")), files,
            anonymous)


def _settles_to(before: tuple[int, int, int, int]) -> tuple[bool, tuple[int, int, int, int]]:
    """Whether the footprint comes back to `before` (anonymous mappings within
    ALLOCATOR_SLACK) within 5 s, and the last sample: a thread just joined can still be
    listed for a moment on a loaded host, one that stays is still seen."""
    deadline = time.monotonic() + 5
    while True:
        sample = _footprint()
        settled = sample[:3] == before[:3] and sample[3] <= before[3] + ALLOCATOR_SLACK
        if settled or time.monotonic() >= deadline:
            return settled, sample
        time.sleep(0.01)


_PYMALLOC_ARENA = 1 << 20  # CPython's small-object arenas: anonymous mappings of 1 MiB


def _pymalloc_arenas_made() -> int:
    """How many small-object arenas CPython has mapped so far (sys._debugmallocstats, which
    writes to fd 2); 0 without pymalloc (PYTHONMALLOC=malloc)."""
    import re
    import tempfile

    sys.stderr.flush()
    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode(errors="replace")
    found = re.search(r"# arenas allocated total\s*=\s*([\d,]+)", text)
    return int(found.group(1).replace(",", "")) if found else 0


def _anonymous_rw(line: str) -> bool:
    """Whether a /proc/self/maps line is anonymous writable memory (no file, not shared)."""
    fields = line.split()
    return len(fields) == 5 and fields[1] == "rw-p"


def _span(line: str) -> tuple[int, int]:
    lo, hi = line.split()[0].split("-")
    return int(lo, 16), int(hi, 16)


def _resources() -> tuple:
    """This process's threads, open fds (with what they are), memory mappings but the malloc
    heap's and the anonymous writable ones, each as a set (what a test made shows as what
    is new), then those anonymous writable mappings as (begin, end) spans and how many
    arenas CPython had mapped: mappings next to each other merge into one line, and a test's
    Python objects that outlive it (a cache, an interned name) can keep an arena of 1 MiB
    that a rank forked from a busier parent had to map anew, so those are counted in bytes."""
    arenas = _pymalloc_arenas_made()
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            pass  # the listing's own fd, closed by now
    with open("/proc/self/maps") as maps:
        lines = [line for line in maps if not line.rstrip().endswith("[heap]")]
    mappings = {line for line in lines if not _anonymous_rw(line)}
    anonymous = sorted(_span(line) for line in lines if _anonymous_rw(line))
    return set(os.listdir("/proc/self/task")), fds, mappings, anonymous, arenas


def _new_bytes(spans: list, before: list) -> int:
    """Bytes of `spans` that no span of `before` covered."""
    new = 0
    for lo, hi in spans:
        new += hi - lo - sum(max(0, min(hi, b) - max(lo, a)) for a, b in before)
    return new


def _left_behind(before: tuple) -> tuple[set, set, set]:
    """The threads, fds and mappings this process holds that it did not hold at `before`, once
    there are none or after 5 s (a thread just joined can still be listed for a moment on a
    loaded host). What went away meanwhile (a group made earlier finishing its own
    teardown on another thread) does not count. New anonymous writable memory counts beyond
    the arenas CPython mapped meanwhile (seen after other tests ran in the same pytest
    process, one arena at the same address in every rank; gone with PYTHONMALLOC=malloc)."""
    deadline = time.monotonic() + 5
    while True:
        threads, fds, mappings, anonymous, arenas = _resources()
        grown = _new_bytes(anonymous, before[3])
        allowed = (arenas - before[4]) * _PYMALLOC_ARENA
        if grown > allowed:
            mappings = mappings | {f"{grown} bytes of new anonymous memory, {allowed} of them "
                                   "CPython's arenas"}
        new = (threads - before[0], fds - before[1], mappings - before[2])
        if not any(new) or time.monotonic() > deadline:
            return new
        time.sleep(0.01)


def body_groups_come_and_go(rank: int, world: int, store_dir: str):
    def cycle(i: int) -> None:
        # A whole job's group (a store rendezvous, the shared segment, loom's threads) ...
        store = dist.FileStore(os.path.join(store_dir, f"cycle{i}"), world)
        dist.init_process_group("loom", store=store, rank=rank, world_size=world)
        # ... and a group over the world's ranks (DeviceMesh's and new_group's way).
        sub = dist.new_group([0, 1], backend="loom")
        x = torch.ones(1 << 14)
        dist.all_reduce(x)
        dist.all_reduce(x, group=sub)
        assert torch.equal(x, torch.full((1 << 14,), float(world * world))), x
        dist.destroy_process_group()
        del store
        gc.collect()

    dist.destroy_process_group()  # the harness's group; the cycles make their own
    for i in range(3):  # what the first groups leave for good (torch's and loom's process state)
        cycle(i)
    before = _footprint()
    with open("/proc/self/maps") as maps:
        mapped_before = set(maps)  # for the message
    for i in range(3, 33):
        cycle(i)
    settled, after = _settles_to(before)
    with open("/proc/self/maps") as maps:
        new_mappings = sorted(set(maps) - mapped_before)
    assert settled, (f"threads, fds, file and anonymous mappings: {before} before 30 groups, "
                     f"{after} after; mappings not there before: {new_mappings}")
    dist.init_process_group("loom", store=dist.FileStore(os.path.join(store_dir, "end"), world),
                            rank=rank, world_size=world)  # for the harness's closing barrier


def test_groups_made_and_destroyed_leave_no_thread_fd_or_mapping(tmp_path):
    """30 groups made, used and destroyed in a row leave the process holding exactly the
    threads, fds and mappings it held before (no loom shared memory or thread outlives its
    group)."""
    run_ranks(2, body_groups_come_and_go, str(tmp_path), timeout=240)


def _merged(i: int, parent, world: int):
    store = dist.PrefixStore(f"merged{i}/", dist.distributed_c10d._get_default_store())
    return parent.merge_remote_group(store, world, timedelta(seconds=60))


def _split(i: int, parent, world: int):
    # torch's split_group less its device checks (CPU), as in test_collectives.py.
    return parent.split_group(list(range(world)), timeout=timedelta(seconds=60),
                              group_name=f"split{i}")


def body_derived_and_dropped(rank: int, world: int, how: str) -> None:
    derive = {"merge": _merged, "split": _split}[how]
    parents = {"merge": lambda: dist.new_group([rank], use_local_synchronization=True),
               "split": lambda: dist.new_group(list(range(world)))}[how]

    def use_and_drop(i: int, parent) -> None:
        child = derive(i, parent, world)
        t = torch.ones(4)
        child.allreduce([t]).wait()
        assert torch.equal(t, torch.full((4,), float(world))), t
        del child
        gc.collect()

    # What a first group leaves for good (torch's and loom's process state), derived from a
    # parent that is gone again ...
    first = parents()
    use_and_drop(0, first)
    dist.destroy_process_group(first)
    del first
    gc.collect()
    # ... then one dropped while its parent lives on: its segment and threads go with it, not
    # with the parent (which remembers its last child, for torch's ask per device type).
    parent = parents()
    before = _resources()
    use_and_drop(1, parent)
    threads, fds, mappings = _left_behind(before)
    assert not (threads or fds or mappings), (
        f"left by the {how}: threads {sorted(threads)}, fds {sorted(fds)}, mappings {sorted(mappings)}")
    dist.barrier()


@pytest.mark.parametrize("how", ["merge", "split"])
def test_a_derived_group_dropped_leaves_nothing_behind(how):
    run_ranks(2, body_derived_and_dropped, how, timeout=120)


def test_importing_loom_leaves_ctrl_c_and_kills_to_python():
    """libfabric's PSM provider (libinfinipath) used to replace the interpreter's SIGINT and
    SIGTERM handlers as loom loaded, with ones that exit(1): Ctrl-C raised no
    KeyboardInterrupt and a SIGTERM read as exit status 1."""
    # The child starts from Python's own handlers whatever it inherits (a pytest-xdist worker
    # ignores SIGINT, and an ignored SIGINT stays ignored in its children).
    script = ("import os, signal, time\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
              "import loom\n"
              "try:\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    time.sleep(5)\n"
              "except KeyboardInterrupt:\n"
              "    print('interrupted')\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "time.sleep(5)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "interrupted", (done.stdout, done.stderr)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr)


def _join_through_a_tcp_store(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("loom", rank=rank, world_size=3, timeout=timedelta(seconds=60))
        results.put((rank, "made"))
    except BaseException as error:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(error).__name__}: {error}"))


def test_a_rank_whose_store_dies_while_it_joins_is_told_so_by_loom():
    """Rank 0, which holds torch's TCPStore, dies while rank 1 waits in loom's creation (rank
    2 never starts): rank 1 is told in loom's words that the store is gone and where it
    lived. It got torch's bare "Failed to recv, got 0 bytes" with a C++ trace."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    holder = ctx.Process(target=_join_through_a_tcp_store, args=(0, port, results), daemon=True)
    holder.start()
    deadline = time.monotonic() + 60
    while True:  # the store listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "rank 0's store never listened"
            time.sleep(0.1)
    joiner = ctx.Process(target=_join_through_a_tcp_store, args=(1, port, results), daemon=True)
    joiner.start()
    time.sleep(3)  # rank 1 waits in loom's creation for rank 2
    os.kill(holder.pid, signal.SIGKILL)
    rank, text = results.get(timeout=90)
    joiner.join(30)
    assert rank == 1, text
    assert "lost torch's store" in text and "rank 0 (or at MASTER_ADDR): did it exit?" in text, text
