"""Bad input is a clear error before anything is sent; ranks that disagree get an error
naming both sides instead of a hang; failures surface as DistBackendError."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from harness import run_ranks


def expect(exc_type, pattern: str, fn) -> None:
    try:
        fn()
    except exc_type as e:  # noqa: PERF203
        assert re.search(pattern, str(e)), f"message does not match {pattern!r}: {e}"
        return
    raise AssertionError(f"expected {exc_type.__name__} matching {pattern!r}")


def body_bad_input(rank: int, world: int) -> None:
    t = torch.ones(4)
    # A tensor on a device loom does not take (meta: neither CPU nor CUDA) reaching the backend
    # (through dist.* torch routes tensors by device, so call the backend directly).
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    expect(RuntimeError, r"loom all_reduce \(rank \d\): tensor is on meta.*CPU and CUDA tensors",
           lambda: backend.allreduce([torch.ones(4, device="meta")]))
    # Root out of range.
    expect((RuntimeError, ValueError), r"root|rank", lambda: dist.broadcast(t, src=world + 3))
    # Mixed dtypes and wrong list lengths inside one call.
    # (torch's Python layer catches some of these before loom does; either way it is refused.)
    expect((RuntimeError, ValueError), r"dtype", lambda: dist.all_gather([torch.ones(4, dtype=torch.int32)] * world, t))
    expect(RuntimeError, r"all_gather \(rank \d\): output 1 has dtype Int",
           lambda: backend.allgather([[torch.ones(4), torch.ones(4, dtype=torch.int32)]], [t]))
    expect((RuntimeError, ValueError), r"tensor", lambda: dist.all_gather([torch.ones(4)] * (world + 1), t))
    expect(RuntimeError, r"all_gather_into_tensor.*elements", lambda: dist.all_gather_into_tensor(torch.empty(3), t))
    expect(RuntimeError, r"reduce_scatter_tensor.*elements", lambda: dist.reduce_scatter_tensor(torch.empty(4), t))
    expect(RuntimeError, r"all_to_all_single.*split sizes add up",
           lambda: dist.all_to_all_single(torch.empty(4), t, [1] * world, [3] * world))
    # A reduction a dtype does not have.
    expect(RuntimeError, r"BAND is not defined for float32", lambda: dist.all_reduce(t, op=dist.ReduceOp.BAND))
    expect(ValueError, r"does not support .*MAX on complex",
           lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.MAX))
    expect(RuntimeError, r"complex tensors can be reduced with SUM, AVG or PREMUL_SUM",
           lambda: backend.allreduce([torch.ones(2, dtype=torch.complex64)], _max_opts()))
    # A complex PREMUL_SUM factor: refused (its real part alone would be a wrong answer).
    expect(RuntimeError, r"all_reduce \(rank \d\): PREMUL_SUM's factor is complex",
           lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64),
                                   op=dist._make_nccl_premul_sum(torch.tensor([1j]))))
    # A factor given as a one-element tensor (torch's supplement holds one element) scales as
    # the number would.
    y = torch.full((3,), float(rank + 1))
    dist.all_reduce(y, op=dist._make_nccl_premul_sum(torch.tensor([0.5], dtype=torch.float64)))
    assert torch.equal(y, torch.full((3,), 0.5 * world * (world + 1) / 2)), y
    # Nothing was sent: the group still works.
    x = torch.ones(3)
    dist.all_reduce(x)
    assert x.tolist() == [world] * 3


def _max_opts():
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    return opts


def body_mismatch(rank: int, world: int) -> None:
    t = torch.ones(100 if rank == 0 else 200)
    expect(dist.DistBackendError, r"rank 0 issued all_reduce #\d+ \(count 100.*rank 1 issued all_reduce #\d+ \(count 200",
           lambda: dist.all_reduce(t))


def body_subgroup_mismatch(rank: int, world: int) -> None:
    """In a group of global ranks 1 and 2 the message numbers them 0 and 1, as the group
    does, and says which global rank each is: through c10d, through the direct entry, and in
    the failure report the engine prints on stderr."""
    import loom.ops  # noqa: F401  (registers torch.ops.loom)

    group = dist.new_group([1, 2], backend="loom")
    direct = dist.new_group([1, 2], backend="loom")
    if rank == 0:
        return
    legend = r"ranks of process group '[^']+'.*its ranks 0 to 1 are global ranks 1, 2"
    t = torch.ones(2 if rank == 1 else 3)
    with tempfile.TemporaryFile() as err:
        # The report goes to the process's stderr: catch it in a file for the call.
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            expect(dist.DistBackendError,
                   r"rank 0 issued all_reduce #\d+ \(count 2.*rank 1 issued all_reduce #\d+ "
                   r"\(count 3.*\(ranks in this message are " + legend + r"\)",
                   lambda: dist.all_reduce(t, group=group))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        report = err.read().decode(errors="replace")
    assert re.search(r"loom: communicator '[^']+' failed on rank \d of 2", report), report
    assert re.search(r"loom: the ranks in this report are " + legend + "\n", report), report
    expect(dist.DistBackendError,
           r"rank 0 issued all_reduce #\d+ \(count 2.*\(ranks in this message are " + legend,
           lambda: torch.ops.loom.all_reduce_(t, "sum", direct.group_name))
    # An argument refused before anything is sent names the group's rank the same way.
    fresh = dist.new_group([1, 2], backend="loom")
    expect(RuntimeError, r"loom all_gather_into_tensor \(rank \d\): .*\(ranks in this message are " + legend,
           lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2), group=fresh))
    # So does a monitored barrier that times out (global rank 2, the group's rank 1, is late).
    monitored = dist.new_group([1, 2], backend="loom")
    if rank == 1:
        expect(dist.DistBackendError,
               r"monitored_barrier: .*rank\(s\) 1 had not arrived.*\(ranks in this message are " + legend,
               lambda: monitored.monitored_barrier(timedelta(seconds=1), True))
        dist.distributed_c10d._get_default_store().set("monitored timed out", "1")
    else:
        dist.distributed_c10d._get_default_store().wait(["monitored timed out"])


def body_collective_mismatch(rank: int, world: int) -> None:
    t = torch.ones(8)
    call = (lambda: dist.all_reduce(t)) if rank == 0 else (lambda: dist.broadcast(t, src=0))
    expect(dist.DistBackendError, r"rank 0 issued all_reduce.*rank 1 issued broadcast", call)


def body_wait_timeout(rank: int, world: int) -> None:
    gloo = dist.new_group(backend="gloo")
    if rank == 0:
        work = dist.all_reduce(torch.ones(4), async_op=True)
        expect(dist.DistBackendError, r"work.wait\(\) timed out after 200 ms", lambda: work.wait(timedelta(milliseconds=200)))
        dist.barrier(group=gloo)  # now rank 1 joins the all_reduce
        work.wait()
    else:
        dist.barrier(group=gloo)
        dist.all_reduce(torch.ones(4))


def body_op_timeout(rank: int, world: int) -> None:
    gloo = dist.new_group(backend="gloo")
    loom_group = dist.new_group(backend="loom", timeout=timedelta(milliseconds=300))
    if rank == 0:
        # Rank 1 never joins: the group's timeout ends the call, naming rank 1.
        expect(dist.DistBackendError, r"all_reduce #1 hit its timeout of 300 ms: rank\(s\) 1 had not arrived",
               lambda: dist.all_reduce(torch.ones(4), group=loom_group))
    dist.barrier(group=gloo)


def body_destroyed_peer(rank: int, world: int) -> None:
    """Rank 1 destroys a group it still holds (destroy_process_group shuts the backend down;
    the object lives on in Python) while rank 0 waits in a call on it that rank 1 never
    makes: rank 0's call fails naming rank 1 as gone, not as late once the timeout passes."""
    gloo = dist.new_group(backend="gloo")
    group = dist.new_group(backend="loom", timeout=timedelta(seconds=60))
    if rank == 0:
        work = dist.all_reduce(torch.ones(4), group=group, async_op=True)
        dist.barrier(group=gloo)  # the call is issued
        expect(dist.DistBackendError, r"rank 1 .*destroyed its communicator", work.wait)
    else:
        dist.barrier(group=gloo)
        dist.destroy_process_group(group)
    dist.barrier(group=gloo)
    del group


def body_destroy_after_giving_up(rank: int, world: int) -> None:
    """Rank 0 gives up waiting for a call rank 1 never makes (work.wait(timeout) expires) and
    destroys the group: that aborts the call at once instead of waiting out its 60-second
    timeout, and rank 1 learns that rank 0 aborted."""
    gloo = dist.new_group(backend="gloo")
    group = dist.new_group(backend="loom", timeout=timedelta(seconds=60))
    if rank == 0:
        work = dist.all_reduce(torch.ones(4), group=group, async_op=True)
        expect(dist.DistBackendError, r"timed out after 1000 ms",
               lambda: work.wait(timeout=timedelta(seconds=1)))
        start = time.monotonic()
        dist.destroy_process_group(group)
        took = time.monotonic() - start
        assert took < 20, f"destroying the group took {took:.1f} s"
        assert work.is_completed() and not work.is_success()
        dist.barrier(group=gloo)
    else:
        dist.barrier(group=gloo)  # rank 0 has destroyed the group
        expect(dist.DistBackendError, r"rank 0 aborted",
               lambda: dist.all_reduce(torch.ones(4), group=group))
        dist.destroy_process_group(group)
    dist.barrier(group=gloo)


def body_refused_batch(rank: int, world: int) -> None:
    """A batch_isend_irecv whose third operation is refused raises its error when the batch
    ends, after torch's coalescing manager has closed its block: had it raised inside the
    block, torch would leave the group coalescing and quietly queue every later all_reduce
    (the result below would stay [rank + 1] * 2). The operations issued before run on."""
    peer = 1 - rank
    got = torch.zeros(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), peer),
           dist.P2POp(dist.irecv, got, peer),
           dist.P2POp(dist.isend, torch.ones(2), 5)]
    expect(RuntimeError, r"argument 'dst' is 5, outside \[0, 2\)", lambda: dist.batch_isend_irecv(ops))
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 3.0], t
    deadline = time.monotonic() + 30  # the refused batch's receive has no work to wait on
    while got.tolist() != [float(peer)] * 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got.tolist() == [float(peer)] * 2, got
    again = torch.zeros(2)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), 7.0), peer),
                                     dist.P2POp(dist.irecv, again, peer)]):
        w.wait()
    assert again.tolist() == [7.0, 7.0], again


def body_failed_batch_settles(rank: int, world: int) -> None:
    """A batch whose one receive fails (its message is larger than its tensor) raises at its
    wait only once its other receive, staged (a transposed tensor), has copied its message
    back: the caller, told of the failure, may reuse that tensor at once. Rank 1 sends the
    staged receive's message last, so its copy-back is the block's last work."""
    for round in range(20):
        if rank == 1:
            dist.send(torch.full((16,), -1.0), 0, tag=1)  # for a receive of 2: too large
            dist.send(torch.arange(8.0) + round, 0, tag=0)
            continue
        staged = torch.zeros(2, 4).t()  # transposed: received into a contiguous copy
        small = torch.zeros(2)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, staged, 1, tag=0),
                                        dist.P2POp(dist.irecv, small, 1, tag=1)])
        expect(RuntimeError, r"larger|bytes", works[-1].wait)
        want = (torch.arange(8.0) + round).reshape(4, 2)  # in the view's order
        assert torch.equal(staged, want), (round, staged)
    dist.barrier()


def test_a_failed_batch_raises_once_its_copy_backs_are_over():
    run_ranks(2, body_failed_batch_settles)


def test_a_refused_operation_of_a_batch_leaves_the_group_usable():
    run_ranks(2, body_refused_batch)


def test_bad_input_is_refused_before_sending():
    run_ranks(2, body_bad_input)


def test_mismatched_sizes_name_both_sides():
    # The group is failed afterwards (as after any collective error), so no closing barrier.
    run_ranks(2, body_mismatch, finalize=False)


def test_errors_in_a_subgroup_say_which_global_rank_each_rank_is():
    run_ranks(3, body_subgroup_mismatch, finalize=False)


def test_mismatched_collectives_name_both_sides():
    run_ranks(2, body_collective_mismatch, finalize=False)


def test_work_wait_timeout():
    run_ranks(2, body_wait_timeout)


def test_group_timeout_names_missing_rank():
    run_ranks(2, body_op_timeout)


def test_destroying_a_group_aborts_the_calls_its_caller_gave_up_on():
    run_ranks(2, body_destroy_after_giving_up)


def test_a_peer_that_destroyed_the_group_is_named():
    run_ranks(2, body_destroyed_peer)


def body_default(rank: int, world: int) -> str:
    return dist.get_backend()


def test_opt_in_default_backend(tmp_path):
    # LOOM_DEFAULT=1 before `import loom`, then init_process_group() with no backend, in a
    # fresh interpreter (the opt-in wraps torch's function for the whole process).
    script = tmp_path / "default.py"
    script.write_text(
        "import os, torch.distributed as dist\n"
        "os.environ['LOOM_DEFAULT'] = '1'\n"
        "import loom\n"
        "dist.init_process_group(init_method='file://" + str(tmp_path / "init") + "', rank=0, world_size=1)\n"
        "print(dist.get_backend())\n"
        "dist.destroy_process_group()\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # loom for CPU tensors; on a host with CUDA, NCCL for CUDA tensors beside it.
    assert out.stdout.strip() in ("loom", "cpu:loom,cuda:nccl"), out.stdout


def test_a_bad_flight_recorder_size_fails_the_group_at_creation(tmp_path):
    # Read when the process's first operation was recorded, it failed that first call, and
    # ranks with a good value waited in it for the timeout. A fresh interpreter: the record's
    # size is read once per process.
    script = tmp_path / "recorder.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "os.environ['LOOM_FLIGHT_RECORDER'] = 'abc'\n"
        "import loom\n"
        "try:\n"
        "    dist.init_process_group('loom', init_method='file://" + str(tmp_path / "init") + "', rank=0, world_size=1)\n"
        "except Exception as e:\n"
        "    print('refused:', e)\n"
        "else:\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "    print('created')\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "refused:" in out.stdout and "LOOM_FLIGHT_RECORDER=abc" in out.stdout, (out.stdout, out.stderr)
