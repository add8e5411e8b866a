"""loom.tensor_store when things go wrong: torn-read protection under a writer putting as fast as
it can, writers and readers killed mid-transfer, puts that fail midway or are refused, a read
racing the release of its buffer, two writers of one key (with and without a process group),
a key deleted by a rank that did not put it or by one rank of a mesh, a mesh put refused on
one of its ranks, and a named version retired as it is read."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import run_alone, run_ranks
from store_samples import on_wait, refresh_until, store_buffers, sync


def _rl_loop(rank, world, steps):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    seen = []
    if rank == 0:  # the trainer: a new version as fast as it can, each filled with its step
        weights = {"w": torch.zeros(1 << 16), "b": torch.zeros(1 << 10, dtype=torch.bfloat16)}
        for step in range(1, steps + 1):
            for t in weights.values():
                t.fill_(step)
            ts.put_state_dict(weights, "policy")
        dist.barrier()  # the writer's buffers live as long as its TensorStore: hold it
    else:  # generators: refresh whenever they can; every read must be one whole version
        mine = {"w": torch.empty(1 << 16), "b": torch.empty(1 << 10, dtype=torch.bfloat16)}
        seen = refresh_until(ts, mine, steps, "")
        # The final version waited for by number, as a generator that wants step N does.
        ts.get_state_dict("policy", mine, version=steps)
        assert float(mine["w"][0]) == steps
        dist.barrier()
    return seen


def test_rl_loop_never_reads_a_torn_version():
    results = run_ranks(3, _rl_loop, 60)
    for seen in results[1:]:
        assert seen == sorted(seen) and seen[-1] == 60


def _writer_dies(rank, world):
    from loom.tensor_store import TensorStore, TensorStoreError
    from loom.tensor_store import _parts

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore()
    if rank == 0:
        ts.put("w", torch.full((1 << 16,), 1.0))
        ts.put("w", torch.full((1 << 16,), 2.0))
        store.set("v2", "1")
        sync(store, "read")

        def write_then_die(self, pieces, bucket_bytes):  # v3 dies half-written, in v1's region
            self.region.begin_write()
            _parts.typed_view(self.data, pieces[0][1], pieces[0][0].dtype, (100,)).copy_(pieces[0][0][:100])
            self.region.set_progress(400)
            store.set("dying", "1")
            sync(store, "mapped3")  # a reader is waiting for the rest of v3
            os.kill(os.getpid(), signal.SIGKILL)

        _parts.OwnedBuffer.write = write_then_die
        ts.put("w", torch.full((1 << 16,), 3.0))
        raise AssertionError("the writer should have died")
    sync(store, "v2")
    pid = ts._parts("w", None, None)[1][0].buffers[0].pid
    if rank == 1:  # reads v2 while the writer lives (and so maps it)
        assert float(ts.get("w")[0]) == 2.0
    if store.add("readers", 1) == 2:
        store.set("read", "1")
    if rank == 1:
        while os.path.exists(f"/proc/{pid}"):  # the writer dies mid-put
            time.sleep(0.01)
        got = ts.get("w")  # v3 never completed: v2 is the latest, and whole
        return ts.latest_version("w"), float(got.min()), float(got.max())
    # Rank 2 waits for v3 as it is written (its part is published before its bytes), and is
    # told when the writer dies; it never mapped v2, so reading that is refused with a reason.
    sync(store, "dying")
    version, parts = ts._parts("w", 3, None)
    ts._mappings.buffer(parts[0], 0)
    store.set("mapped3", "1")
    with pytest.raises(TensorStoreError, match=r"version 3: rank 0 \(pid \d+\) died while writing it"):
        ts.get("w", version=3)
    with pytest.raises(TensorStoreError, match="rank 0.*(exited|released)"):
        ts.get("w")
    return "told"


def test_writer_killed_mid_put_leaves_previous_version():
    results = run_ranks(3, _writer_dies, killed=(0,), finalize=False)
    assert results == ["killed", (2, 2.0, 2.0), "told"]


def _writer_gone(rank, world):
    from loom.tensor_store import TensorStore, TensorStoreError

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore()
    if rank == 0:
        ts.put("w", torch.full((16,), 1.0))
        sync(store, "read1")
        os.kill(os.getpid(), signal.SIGKILL)  # between puts, as a trainer that crashed
    assert float(ts.get("w", version=1)[0]) == 1.0
    store.set("read1", "1")
    # The next version will not come: told so, naming the writer, not after the timeout.
    with pytest.raises(TensorStoreError, match=r"version=2\): rank 0 \(pid \d+\), which wrote version 1, "
                                               r"has exited"):
        ts.get("w", version=2, timeout=timedelta(seconds=120))
    return "told"


def test_a_get_waiting_for_a_version_from_a_writer_that_exited_is_told():
    assert run_ranks(2, _writer_gone, killed=(0,), finalize=False) == ["killed", "told"]


def _writer_dies_as_read(rank, world):
    from loom.tensor_store import TensorStore, TensorStoreError, _parts

    store = dist.distributed_c10d._get_default_store()
    # 4 KiB buckets, a tensor of 4 KiB in each: the reader copies bucket by bucket as written.
    ts = TensorStore(bucket_bytes=4096, timeout=timedelta(seconds=60))
    weights = {"a": torch.full((1024,), 1.0), "b": torch.full((1024,), 1.0)}
    if rank == 0:
        ts.put_state_dict(weights, "w")
        sync(store, "reading")
        copies = _parts.run_copies
        done = []

        def die_in_the_second_bucket(groups, *args):
            copies(groups, *args)
            done.append(1)
            if len(done) == 2:  # bucket 1's progress is published as the next copy starts
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)

        _parts.run_copies = die_in_the_second_bucket
        for t in weights.values():
            t.fill_(2.0)
        ts.put_state_dict(weights, "w")
    mine = {"a": torch.zeros(1024), "b": torch.zeros(1024)}
    ts.get_state_dict("w", mine, version=1)
    store.set("reading", "1")
    # Filled as version 2 is written; the writer dies half way: the error says the version
    # before is readable and that the tensors may hold part of version 2 (a holds it).
    with pytest.raises(TensorStoreError, match=r"died while writing it.*the tensors this get_state_dict was "
                                               r"filling may "
                                               r"hold part of a version it could not read whole"):
        ts.get_state_dict("w", mine, version=2)
    return mine["a"][0].item(), mine["b"][0].item()


def test_a_get_filling_as_written_whose_writer_dies_says_the_tensors_hold_part_of_it():
    assert run_ranks(2, _writer_dies_as_read, killed=(0,), finalize=False) == ["killed", (2.0, 1.0)]


def _two_jobs(rank, world):
    from loom import _C
    from loom.tensor_store import TensorStore

    if not getattr(_C, "has_network", False):
        return "no network transport"
    first, second = dist.HashStore(), dist.HashStore()
    TensorStore(first, rank=0).put("x", torch.ones(4))  # this process now serves the first job
    writer, reader = TensorStore(second, rank=0), TensorStore(second, rank=1)
    writer.put("x", torch.full((4,), 2.0))  # refused before: "one process serves one job"
    writer.put("x", torch.full((4,), 3.0))
    part = reader._decode(reader._get_now("k/x/v2/p0"), 2)
    return reader.get("x").tolist(), part.server, part.unserved


def test_a_second_job_in_one_process_puts_for_readers_on_its_host():
    # Serving buffers across hosts is one job per process; a TensorStore on a second job's
    # Store still puts, readable on its host, and says why readers elsewhere cannot read it.
    result = run_alone(_two_jobs)
    if result == "no network transport":
        pytest.skip("this loom was built without its network transport")
    values, server, unserved = result
    assert values == [3.0] * 4 and server is None
    assert "another job" in unserved and "serve_remote=False" in unserved, unserved


def test_a_writer_that_exited_is_gone_before_its_parent_reaps_it():
    # A killed writer whose parent has not waited for it yet is a zombie: its /proc entry
    # stays, and a reader that looked only for that entry waited out its whole timeout.
    from loom.tensor_store._parts import BufferMeta, process_start

    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 30
        while open(f"/proc/{child}/stat").read().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        assert process_start(child) is None
        assert not BufferMeta("cpu", child, 0, "r", 0).owner_alive()
    finally:
        os.waitpid(child, 0)
    # A live process is alive, and one with its pid but another start time (a pid reused) is not.
    me = process_start(os.getpid())
    assert me is not None and BufferMeta("cpu", os.getpid(), 0, "r", 0, started=me).owner_alive()
    assert not BufferMeta("cpu", os.getpid(), 0, "r", 0, started=me + 1).owner_alive()
    assert BufferMeta("cpu", os.getpid(), 0, "r", 0).owner_alive()  # a part without a start time


def test_a_get_waiting_for_a_version_the_writers_skipped_is_told():
    from loom.tensor_store import TensorStore, TensorStoreError

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=60))
    writer, reader = (TensorStore(store, serve_remote=False, rank=r) for r in (0, 1))
    try:
        writer.put("k", torch.ones(4))  # version 1
        caught = []

        def read():
            try:
                reader.get("k", version=3, timeout=timedelta(seconds=120))
            except Exception as error:  # noqa: BLE001 - checked below
                caught.append(error)

        waiting = threading.Thread(target=read)
        waiting.start()
        time.sleep(0.2)
        writer.put("k", torch.ones(4), version=5)  # 2 to 4 never come
        waiting.join()
        assert len(caught) == 1 and isinstance(caught[0], TensorStoreError), caught
        assert "went on to version 5 without completing this one" in str(caught[0]), caught
        # Asked afterwards, a skipped version is said to be one, not one retired: version 1,
        # before it, is still kept (keep=2).
        with pytest.raises(TensorStoreError, match=r"version=4\): that version was never completed"):
            reader.get("k", version=4)
        assert reader.get("k", version=1).tolist() == [1.0] * 4
    finally:
        writer.close()
        reader.close()


def _reader_dies(rank, world):
    from loom.tensor_store import TensorStore

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore()
    if rank == 0:
        ts.put("w", torch.full((1 << 18,), 1.0))
        store.set("v1", "1")
        while os.path.exists(f"/proc/{int(store.get('reader_pid'))}"):
            time.sleep(0.01)
        for step in (2, 3, 4):  # the writer goes on; its buffers stay bounded
            ts.put("w", torch.full((1 << 18,), float(step)))
        store.set("v4", "1")
        sync(store, "read4")  # its buffers live as long as its TensorStore
        return store_buffers()[0]
    sync(store, "v1")
    if rank == 1:  # killed in the middle of copying a version out
        store.set("reader_pid", str(os.getpid()))
        import loom.tensor_store._read_plan as read_plan

        read_plan.run_copies = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
        ts.get("w")
        raise AssertionError("the reader should have died")
    sync(store, "v4")
    got = float(ts.get("w")[0])
    store.set("read4", "1")
    return got


def test_reader_killed_mid_get_leaves_writer_and_others_unharmed():
    results = run_ranks(3, _reader_dies, killed=(1,), finalize=False)
    assert results == [2, "killed", 4.0]


def _filled(value: float) -> dict:
    """Eight 4 KiB tensors: eight buckets of 4 KiB."""
    return {f"t{i}": torch.full((1024,), value) for i in range(8)}


def _failed_put(rank, world):
    from loom.tensor_store import TensorStore, TensorStoreError
    from loom.tensor_store import _parts

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore(bucket_bytes=4096)
    if rank == 0:
        ts.put_state_dict(_filled(1.0), "w")
        sync(store, "asking2")
        copies, calls = _parts.run_copies, []

        def fail_second_bucket(*args):
            calls.append(1)
            if len(calls) == 2:
                sync(store, "reading2")  # the reader has the first bucket of version 2
                raise RuntimeError("injected: a copy failed")
            copies(*args)

        _parts.run_copies = fail_second_bucket
        with pytest.raises(RuntimeError, match="injected"):
            ts.put_state_dict(_filled(2.0), "w")
        _parts.run_copies = copies
        store.set("failed2", "1")
        sync(store, "checked")
        return ts.put_state_dict(_filled(3.0), "w")
    # The reader waits for version 2 and starts copying it as it is written; the write fails.
    store.set("asking2", "1")
    run = _parts.MappedBuffer.state

    def signal_once_writing(self, generation):
        state = run(self, generation)
        if state == "writing" and not store.check(["reading2"]):
            store.set("reading2", "1")
        return state

    _parts.MappedBuffer.state = signal_once_writing
    with pytest.raises(TensorStoreError, match="version=2"):
        ts.get_state_dict("w", version=2)
    sync(store, "failed2")
    latest = ts.latest_version("w")
    value = {float(t.max()) for t in ts.get_state_dict("w").values()} | {float(t.min()) for t in ts.get_state_dict("w").values()}
    store.set("checked", "1")
    return latest, value


def test_a_put_that_fails_midway_is_never_read():
    results = run_ranks(2, _failed_put)
    assert results == [3, (1, {1.0})]


def _failed_puts(rank, world):
    from loom.tensor_store import TensorStore
    from loom.tensor_store import _parts

    ts = TensorStore()
    if rank == 0:
        ts.put("w", torch.full((1024,), 1.0))
        ts.put("w", torch.full((1024,), 2.0))
        copies = _parts.run_copies

        def interrupted(*args):
            raise KeyboardInterrupt("injected: the put is interrupted midway")

        _parts.run_copies = interrupted
        for step in (3, 4):  # two puts in a row fail: neither may retire version 2
            with pytest.raises(KeyboardInterrupt):
                ts.put("w", torch.full((1024,), float(step)))
        _parts.run_copies = copies
    dist.barrier()
    out = (ts.latest_version("w"), float(ts.get("w")[0]))
    dist.barrier()
    if rank == 0:  # the writer goes on after them, its latest version kept
        assert ts.put("w", torch.full((1024,), 5.0)) == 5
    dist.barrier()
    out = out, float(ts.get("w", version=2)[0]), float(ts.get("w")[0])
    dist.barrier()  # the writer's buffers live as long as its store
    return out


def test_failed_puts_leave_the_latest_version_readable():
    assert run_ranks(2, _failed_puts) == [((2, 2.0), 2.0, 5.0)] * 2


def _retired_while_opened(rank, world):
    from loom.tensor_store import TensorStore, TensorStoreError

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore()
    # Sizes too different for one version's buffer to be reused by the next: a put that
    # retires a version (the one before the one before it) frees its buffer.
    sizes = {1: 1 << 10, 2: 1 << 16, 3: 1 << 19, 4: 1 << 10, 5: 1 << 16}
    if rank == 0:
        ts.put("w", torch.full((sizes[1],), 1.0))
        store.set("put1", "1")
        for v in (2, 3, 4, 5):
            sync(store, f"go{v}")
            ts.put("w", torch.full((sizes[v],), float(v)))
            store.set(f"put{v}", "1")
        sync(store, "read")
        return None

    def racing(reader, puts):
        """Between looking the version up and opening its buffer, the writer puts `puts`."""
        looked_up = reader._parts

        def parts(*args, **kwargs):
            reader._parts = looked_up
            found = looked_up(*args, **kwargs)
            for v in puts:
                store.set(f"go{v}", "1")
            sync(store, f"put{puts[-1]}")
            return found

        reader._parts = parts

    sync(store, "put1")
    racing(ts, (2, 3))
    got = ts.get("w")  # looked up version 1, whose buffer is gone when opened: read again
    out = [float(got.min()), float(got.max()), got.numel()]
    other = TensorStore()  # a reader that never mapped version 3
    racing(other, (4, 5))
    with pytest.raises(TensorStoreError, match=r"'w' version 3: cannot open the buffer of rank 0"):
        other.get("w", version=3)  # a version asked for by number is not swapped for a newer one
    store.set("read", "1")
    return out


def test_read_of_the_latest_that_races_its_buffer_release_is_retried():
    assert run_ranks(2, _retired_while_opened)[1] == [3.0, 3.0, 1 << 19]


def _two_writers(rank, world):
    from loom.tensor_store import TensorStore

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore()
    if rank == 0:
        assert ts.put("k", torch.full((4,), 1.0)) == 1
    dist.barrier()
    if rank == 1:  # another rank goes on with the key: it numbers from the latest
        assert ts.put("k", torch.full((4,), 2.0)) == 2
    dist.barrier()
    out = [float(ts.get("k")[0])]
    dist.barrier()
    if rank == 0:  # its own count says 2, which rank 1 has put: refused, nothing lost
        with pytest.raises(ValueError, match=r"put\('k'\): version 2 of that key was put by rank\(s\) 1"
                                             r".*the latest is 2.*version= above it"):
            ts.put("k", torch.full((4,), 3.0))
        assert ts.put("k", torch.full((4,), 4.0), version=3) == 3
    dist.barrier()
    out.append(float(ts.get("k")[0]))
    dist.barrier()
    # Lends are numbered the same way: rank 0 lends "m" (1), rank 1 goes on (2), and rank 0's
    # lend again, numbered 2 by its own count, is refused.
    ts.make_lendable({"t": (lent := torch.full((4,), 5.0 + rank))})
    if rank == 0:
        assert ts.lend("m", lent) == 1
    dist.barrier()
    if rank == 1:
        assert ts.lend("m", lent) == 2
    dist.barrier()
    if rank == 0:
        with pytest.raises(ValueError, match=r"lend\('m'\): version 2 of that key was put by rank\(s\) 1"):
            ts.lend("m", lent)
        store.set("refused", "1")
    sync(store, "refused")
    out.append(float(ts.get("m")[0]))  # rank 1's lend is the latest, whole
    dist.barrier()
    return out


def test_two_writers_of_a_key_never_publish_the_same_version():
    assert run_ranks(2, _two_writers) == [[2.0, 4.0, 6.0], [2.0, 4.0, 6.0]]


def _writer_left_behind(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    if rank == 1:
        assert ts.put("k", torch.full((4,), 1.0)) == 1
    dist.barrier()
    if rank == 0:  # goes on to 5, retiring 2 and 3 (two kept)
        for v in range(2, 6):
            assert ts.put("k", torch.full((4,), float(v))) == v
    dist.barrier()
    out = None
    if rank == 1:  # its own count says 2, retired since: refused, not published unseen
        with pytest.raises(ValueError, match=r"put\('k'\): version 2 is not above the latest, 5.*version= above it"):
            ts.put("k", torch.full((4,), 9.0))
        out = ts.put("k", torch.full((4,), 6.0), version=6)
    dist.barrier()
    got = float(ts.get("k")[0]), ts.latest_version("k")
    dist.barrier()
    return out, got


def test_a_writer_left_behind_by_another_is_refused_not_lost():
    # Its put used to take number 2 (its record retired) and return it; nobody saw it.
    assert run_ranks(2, _writer_left_behind) == [(None, (6.0, 6)), (6, (6.0, 6))]


def _writer_without_a_group(path: str, me: int, results) -> None:
    """A process of a job that has a Store and no process group (every TensorStore in it is
    rank 0): puts version 1 of "k" when told to, at the same time as another such process."""
    try:
        from loom.tensor_store import TensorStore

        store = dist.FileStore(path, 3)
        store.set_timeout(timedelta(seconds=120))
        ts = TensorStore(store)
        store.add("ready", 1)
        sync(store, "go")
        try:
            results.put(("put", me, ts.put("k", torch.full((1024,), float(me + 1)), version=1)))
        except ValueError as error:
            results.put(("put", me, str(error)))
        sync(store, "all put")
        results.put(("read", me, (ts.latest_version("k"), float(ts.get("k")[0]))))
        sync(store, "all read")  # the writer's buffers live as long as its store
    except BaseException:  # noqa: BLE001  (the test reports it)
        results.put(("error", me, traceback.format_exc()))


def test_two_processes_without_a_process_group_never_publish_the_same_version(tmp_path):
    # A FileStore: no server thread in this (pytest's) process, which later tests fork from.
    path = str(tmp_path / "store")
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_writer_without_a_group, args=(path, me, results), daemon=True) for me in (0, 1)]
    for proc in procs:
        proc.start()
    master = None
    got: dict = {}

    def collect(what: str) -> None:
        for _ in procs:
            kind, me, value = results.get(timeout=120)
            assert kind == what, f"process {me}: {value}"
            got[what, me] = value

    try:
        master = dist.FileStore(path, 3)
        master.set_timeout(timedelta(seconds=120))
        master.wait(["ready"], timedelta(seconds=120))
        while master.add("ready", 0) < 2:
            time.sleep(0.01)
        master.set("go", "1")
        collect("put")
        master.set("all put", "1")
        collect("read")
    finally:
        if master is not None:
            master.set("all put", "1")
            master.set("all read", "1")
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    # One of them took version 1; the other was refused, naming the winner (where both took
    # the number at once) or the latest (where the winner's put ended first), and nothing
    # was lost.
    winners = [me for me in (0, 1) if got["put", me] == 1]
    assert len(winners) == 1, got
    loser = 1 - winners[0]
    refusal = got["put", loser]
    assert (f"version 1 of that key was put by rank(s) 0 (pid {procs[winners[0]].pid})" in refusal
            or "versions must be integers that grow; the last version of this key is 1" in refusal), got
    assert got["read", 0] == got["read", 1] == (1, float(winners[0] + 1))


def _deleted_by_a_reader(rank, world):
    from loom.tensor_store import TensorStore

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore(timeout=timedelta(seconds=20))
    if rank == 0:
        ts.put("k", torch.ones(2))
    dist.barrier()
    if rank == 1:
        ts.delete("k")  # a rank that did not put it
    dist.barrier()
    if rank == 0:  # the writer goes on with the key once a reader waits for its next version
        sync(store, "waiting")
        assert ts.put("k", torch.full((2,), 2.0)) == 2
        dist.barrier()
        return None
    on_wait(ts, lambda: store.set("waiting", "1"))
    out = ts.get("k", version=2).tolist(), ts.latest_version("k"), ts.get("k").tolist()
    dist.barrier()
    return out


def test_a_key_deleted_by_a_rank_that_did_not_put_it_is_read_again_once_put():
    assert run_ranks(2, _deleted_by_a_reader)[1] == ([2.0, 2.0], 2, [2.0, 2.0])


def _deleted_by_one_rank_of_a_mesh(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from loom.tensor_store import TensorStore

    ts = TensorStore(timeout=timedelta(seconds=20))
    mesh = init_device_mesh("cpu", (world,))

    def put(step):
        ts.put_state_dict({"w": distribute_tensor(torch.full((8, 2), float(step)), mesh, [Shard(0)])}, "p")

    put(1)
    put(2)
    dist.barrier()
    if rank == 1:
        ts.delete("p")
    dist.barrier()
    put(3)  # numbered alike on both ranks (rank 1 used to start again from 1)
    dist.barrier()
    out = ts.exists("p") and (ts.latest_version("p"), sorted(set(ts.get_state_dict("p")["w"].flatten().tolist())))
    dist.barrier()
    return out


def test_a_key_deleted_by_one_rank_of_a_mesh_is_put_again_by_all():
    assert run_ranks(2, _deleted_by_one_rank_of_a_mesh) == [(3, [3.0])] * 2


def _refused_put(rank, world):
    from loom.tensor_store import TensorStore, TensorStoreError
    from loom.tensor_store import _store

    ts = TensorStore()
    if rank == 0:
        ts.put("w", torch.full((16,), 1.0))
        ts.put("w", torch.full((16,), 2.0))
        before = store_buffers()[0]
        real = _store._available_memory
        _store._available_memory = lambda: 1 << 20  # as if the host had 1 MiB free
        try:
            with pytest.raises(MemoryError, match=r"put\('w'\) needs 4194304 bytes of shared memory"):
                ts.put("w", torch.zeros(1 << 20))
        finally:
            _store._available_memory = real
        assert store_buffers()[0] == before  # nothing freed, nothing made
    dist.barrier()
    # Both kept versions are still there: the refused put retired neither.
    out = [float(ts.get("w", version=v)[0]) for v in (1, 2)] + [ts.latest_version("w")]
    dist.barrier()
    if rank == 0:  # its number is free again, and the next put retires the oldest as usual
        assert ts.put("w", torch.full((16,), 3.0)) == 3
    dist.barrier()
    with pytest.raises(TensorStoreError, match=r"version=1.*no longer kept"):
        ts.get("w", version=1)
    out.append(float(ts.get("w")[0]))
    dist.barrier()  # the writer's buffers live as long as its store
    return out


def test_a_put_refused_for_memory_leaves_the_kept_versions_readable():
    assert run_ranks(2, _refused_put) == [[1.0, 2.0, 2, 3.0]] * 2


def _mesh_put_refused_on_one_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from loom.tensor_store import _store
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    mesh = init_device_mesh("cpu", (world,))

    def sd(step):
        return {"w": distribute_tensor(torch.full((1 << 16, 4), float(step)), mesh, [Shard(0)])}

    ts.put_state_dict(sd(1), "policy")
    refused = False
    real = _store._available_memory
    if rank == 1:  # this rank's buffers are refused for step 2; rank 0 publishes its part
        _store._available_memory = lambda: 1 << 10
    try:
        ts.put_state_dict(sd(2), "policy")
    except MemoryError:
        refused = True
    finally:
        _store._available_memory = real
    ts.put_state_dict(sd(3), "policy")  # both ranks number it alike
    dist.barrier()
    got = ts.get_state_dict("policy")["w"]
    out = refused, ts.latest_version("policy"), sorted(set(got.flatten().tolist()))
    dist.barrier()
    return out


def test_a_mesh_put_refused_on_one_rank_never_mixes_two_steps():
    # Rank 1 used to number its next put as the one refused, completing version 2 with rank
    # 0's step-2 part beside its own step-3 part.
    assert run_ranks(2, _mesh_put_refused_on_one_rank) == [(False, 3, [3.0]), (True, 3, [3.0])]


def _mesh_rank_fails_its_parts(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from loom.tensor_store import _parts
    from loom.tensor_store import TensorStore, TensorStoreError

    ts = TensorStore()
    mesh = init_device_mesh("cpu", (world,))

    def sd(step):
        # From the local shard (distribute_tensor would scatter: a collective per put).
        return {"w": DTensor.from_local(torch.full((1 << 11, 4), float(step)), mesh, [Shard(0)])}

    ts.put_state_dict(sd(1), "policy")
    ts.put_state_dict(sd(2), "policy")
    dist.barrier()
    waited = []
    if rank == 0:  # a reader waiting for version 3, which the mesh never completes
        def wait_for_3():
            try:
                TensorStore().get_state_dict("policy", version=3, timeout=timedelta(seconds=120))
            except TensorStoreError as error:
                waited.append(str(error))
        waiting = threading.Thread(target=wait_for_3)
        waiting.start()
    copies = _parts.run_copies
    if rank == 1:  # rank 1's parts of steps 3 and 4 fail midway; rank 0's are written
        def interrupted(*args):
            raise KeyboardInterrupt("injected: the put is interrupted midway")
        _parts.run_copies = interrupted
    for step in (3, 4):
        try:
            ts.put_state_dict(sd(step), "policy")
        except KeyboardInterrupt:
            assert rank == 1
    _parts.run_copies = copies
    dist.barrier()
    # Rank 0 kept its part of version 2, the latest complete one, rather than the parts of
    # 3 and 4 that will never be complete.
    out = ts.latest_version("policy"), sorted(set(ts.get_state_dict("policy")["w"].flatten().tolist()))
    if rank == 0:
        waiting.join(timeout=60)
        out += (waited,)
    dist.barrier()
    ts.put_state_dict(sd(5), "policy")  # both ranks go on, and its part of 5 completes it
    dist.barrier()
    out += (ts.latest_version("policy"), sorted(set(ts.get_state_dict("policy")["w"].flatten().tolist())))
    dist.barrier()
    ts.put_state_dict(sd(6), "policy")  # with 5 complete, the abandoned versions' entries go
    dist.barrier()
    left = [name for v in (3, 4) for name in (f"k/policy/v{v}/done", f"k/policy/v{v}/writers")
            if ts._get_now(name) is not None]
    assert left == [], f"entries of abandoned versions left in the Store: {left}"
    dist.barrier()
    return out


def test_failed_mesh_parts_leave_the_latest_complete_version_readable():
    # Rank 0 used to retire its part of version 2 at its put of version 4, counting its part
    # of version 3 (which rank 1 failed) as kept: no complete version was readable.
    out = run_ranks(2, _mesh_rank_fails_its_parts)
    assert out[1] == (2, [2.0], 5, [5.0]), out[1]
    assert out[0][:2] == (2, [2.0]) and out[0][3:] == (5, [5.0]), out[0]
    assert len(out[0][2]) == 1 and "failed its part" in out[0][2][0], out[0][2]


def _mesh_rank_runs_ahead(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from loom.tensor_store import TensorStore, TensorStoreError

    ts = TensorStore()  # keep=2
    mesh = init_device_mesh("cpu", (world,))

    def sd(step):
        # From the local shard (distribute_tensor would scatter: a collective per put).
        return {"w": DTensor.from_local(torch.full((1 << 11, 4), float(step)), mesh, [Shard(0)])}

    ts.put_state_dict(sd(1), "policy")
    dist.barrier()
    refused = ""
    if rank == 0:  # rank 1 has not put versions 2-4 yet: rank 0 keeps its parts of them
        for step in (2, 3, 4):
            ts.put_state_dict(sd(step), "policy")
        try:
            ts.put_state_dict(sd(5), "policy")  # 4 kept, none complete but the first
        except TensorStoreError as error:
            refused = str(error)
    dist.barrier()
    read_behind = sorted(set(ts.get_state_dict("policy")["w"].flatten().tolist()))
    dist.barrier()
    if rank == 1:  # it catches up: each of its parts completes a version rank 0 kept
        for step in (2, 3, 4, 5):  # (5: the one rank 0 was refused; never complete)
            ts.put_state_dict(sd(step), "policy")
    dist.barrier()
    out = refused, read_behind, ts.latest_version("policy"), sorted(set(ts.get_state_dict("policy")["w"].flatten().tolist()))
    dist.barrier()
    # Both go on in step: the next version is one step's parts (rank 0 numbered it past the
    # one refused, as rank 1 did; it used to number it 5, completing it with rank 1's step 5).
    assert ts.put_state_dict(sd(6), "policy") == 6
    dist.barrier()
    out += (ts.latest_version("policy"), sorted(set(ts.get_state_dict("policy")["w"].flatten().tolist())))
    dist.barrier()
    return out


def test_a_mesh_rank_ahead_of_its_peers_keeps_its_parts_until_they_complete():
    out = run_ranks(2, _mesh_rank_runs_ahead)
    assert out[1] == ("", [1.0], 4, [4.0], 6, [6.0]), out[1]
    refused, *rest = out[0]
    assert rest == [[1.0], 4, [4.0], 6, [6.0]], out[0]
    assert "has not completed version 2" in refused and "global ranks [1]" in refused, refused


def _named_version_retired_as_read(rank, world):
    from loom.tensor_store import TensorStore, TensorStoreError

    ts = TensorStore()
    if rank == 0:
        ts.put("k", torch.full((4,), 1.0))
    dist.barrier()
    stale = ts._latest("k")  # version 1 is the latest: a get of it named reads its parts next
    dist.barrier()
    if rank == 0:
        ts.put("k", torch.full((4,), 2.0))
        ts.put("k", torch.full((4,), 3.0))  # retires version 1 (two kept)
    dist.barrier()
    out = None
    if rank == 1:  # as if version 1 were retired between the reader's two looks
        real, looks = ts._latest, iter([stale])
        ts._latest = lambda key: next(looks, None) or real(key)
        try:
            out = ts.get("k", version=1).tolist()
        except TensorStoreError as e:
            out = "no longer kept" in str(e)
        ts._latest = real
        out = out, ts.get("k").tolist()
    dist.barrier()
    return out


def test_a_named_version_retired_as_it_is_read_is_refused_not_replaced():
    # It used to be read again as the latest: get(version=1) returned version 3's values.
    assert run_ranks(2, _named_version_retired_as_read)[1] == (True, [3.0] * 4)


def test_a_get_that_fails_after_filling_part_of_the_callers_tensors_says_so():
    """A reader fills its live weights in place; the writer reclaims its lent version between
    two of the reader's copies, changes its tensors and never lends again. The get fails at
    its timeout, and its error says the weights may hold part of a replaced version (they
    do: one from version 2, one from the writer's half-done step)."""
    from loom.tensor_store import TensorStore
    from loom.tensor_store import _read_plan

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=2))
    writer = TensorStore(store, rank=0, serve_remote=False)
    reader = TensorStore(store, rank=1, serve_remote=False, timeout=timedelta(seconds=1))
    model = {"a": torch.full((4, 4), 1.0), "b": torch.full((4, 4), 1.0)}
    writer.make_lendable(model)
    writer.lend_state_dict(model, "policy")
    weights = {"a": torch.zeros(4, 4), "b": torch.zeros(4, 4).t()}
    reader.get_state_dict("policy", weights)
    copies = _read_plan.run_copies

    def reclaimed_between(groups, *args):
        copies(groups[:1], *args)
        writer.reclaim("policy")
        with torch.no_grad():
            for t in model.values():
                t.fill_(7.0)
        copies(groups[1:], *args)

    reader._read_plans.clear()
    with writer.updating("policy"), torch.no_grad():
        for t in model.values():
            t.fill_(2.0)
    _read_plan.run_copies = reclaimed_between
    try:
        with pytest.raises(TimeoutError, match=r"get_state_dict\('policy'\).*did not lend the next.*the "
                                               r"tensors this get_state_dict was filling "
                                               "may hold part of a version it could not read whole"):
            reader.get_state_dict("policy", weights)
    finally:
        _read_plan.run_copies = copies
    writer.close()
    reader.close()
