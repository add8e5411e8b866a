"""Bad input through torch.distributed on loom: wrong types, dtypes, sizes, split sizes, ranks
and layouts are refused with an error naming the op and the argument, and the group still
works after; empty and non-contiguous tensors and a world of one give the right results."""

from __future__ import annotations

import re
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

ANY_ERROR = (RuntimeError, ValueError, TypeError, AttributeError)


def expect(exc_type, pattern: str, fn) -> None:
    try:
        fn()
    except exc_type as e:  # noqa: PERF203
        assert re.search(pattern, str(e), re.S), f"message does not match {pattern!r}: {e}"
        return
    raise AssertionError(f"expected {exc_type} matching {pattern!r}")


def still_works(world: int) -> None:
    x = torch.arange(3, dtype=torch.float64)
    dist.all_reduce(x)
    assert x.tolist() == [world * i for i in range(3)], x


def body_wrong_arguments(rank: int, world: int) -> None:
    t = torch.ones(4)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    # Not tensors at all (torch's Python layer refuses these before the backend sees them).
    expect(ANY_ERROR, r"", lambda: dist.all_reduce([1.0, 2.0]))
    expect(ANY_ERROR, r"", lambda: dist.broadcast(3, src=0))
    expect(ANY_ERROR, r"", lambda: dist.all_gather(t, t))
    # Mixed dtypes between input and output.
    expect(ANY_ERROR, r"dtype",
           lambda: dist.all_gather_into_tensor(torch.empty(4 * world, dtype=torch.float64), t))
    expect(ANY_ERROR, r"dtype",
           lambda: dist.reduce_scatter_tensor(torch.empty(4, dtype=torch.int32), torch.ones(4 * world)))
    expect(ANY_ERROR, r"dtype",
           lambda: dist.all_to_all_single(torch.empty(4 * world, dtype=torch.int64), torch.ones(4 * world)))
    # Wrong output sizes for the into-one-tensor collectives.
    for n in (0, 4 * world - 1, 4 * world + 4):
        expect(ANY_ERROR, r"all_gather_into_tensor.*output has %d elements" % n,
               lambda: dist.all_gather_into_tensor(torch.empty(n), t))
        expect(ANY_ERROR, r"reduce_scatter_tensor.*input has %d elements" % n,
               lambda: dist.reduce_scatter_tensor(t.clone(), torch.ones(n)))
    # all_to_all_single split sizes: negative, wrong sum, wrong length, uneven without splits.
    x = torch.ones(2 * world)
    expect(ANY_ERROR, r"all_to_all_single.*split sizes must not be negative",
           lambda: dist.all_to_all_single(torch.empty(2 * world), x, [-1, 2 * world + 1] + [0] * (world - 2), None))
    expect(ANY_ERROR, r"all_to_all_single.*split sizes add up to",
           lambda: dist.all_to_all_single(torch.empty(2 * world), x, None, [1] * world))
    expect(ANY_ERROR, r"all_to_all_single.*input_split_sizes has 1 entries; it needs one per rank",
           lambda: dist.all_to_all_single(torch.empty(2 * world), x, None, [2 * world]))
    expect(ANY_ERROR, r"all_to_all_single.*do not divide evenly",
           lambda: dist.all_to_all_single(torch.empty(2 * world + 1), torch.ones(2 * world + 1)))
    # Without split sizes each rank's block of the output takes a block of the input: an
    # output of another size is refused (it used to be written past its end).
    expect(ANY_ERROR, r"all_to_all_single.*output has .* bytes but the input has",
           lambda: dist.all_to_all_single(torch.empty(world), torch.ones(2 * world)))
    expect(ANY_ERROR, r"all_to_all_single.*output has .* bytes but the input has",
           lambda: dist.all_to_all_single(torch.empty(4 * world), torch.ones(2 * world)))
    # Sizes whose sum wraps int64 to the right total.
    expect(ANY_ERROR, r"all_to_all_single.*split sizes add up to",
           lambda: dist.all_to_all_single(torch.empty(2 * world), x, None,
                                          [2**63 - 1, 2**63 - 1, 2 + 2 * world] if world == 3
                                          else [2**63 - 1] + [2 * world - 1] + [0] * (world - 2)))
    # Out-of-range roots and peers, negative and >= world.
    for bad in (-1, world, world + 5):
        expect(ANY_ERROR, r"rank|root|src|dst|group", lambda: dist.broadcast(t, src=bad))
        expect(ANY_ERROR, r"rank|root|src|dst|group", lambda: dist.reduce(t, dst=bad))
        expect(ANY_ERROR, r"rank|root|src|dst|group", lambda: dist.send(t, dst=bad))
        # src=-1 once became an any-source receive that waited out the group timeout.
        expect(RuntimeError, r"loom recv \(rank \d\): argument '(src|peer)' is %d" % bad,
               lambda: dist.recv(t, src=bad))
        expect(ANY_ERROR, r"rank|root|src|dst|group", lambda: dist.gather(t, None, group_dst=bad))
        expect(ANY_ERROR, r"rank|root|src|dst|group", lambda: dist.scatter(t, None, group_src=bad))
        # Straight to the backend, past torch's own checks.
        opts = dist.BroadcastOptions()
        opts.rootRank = bad
        expect(RuntimeError, r"loom broadcast \(rank \d\): root %d is outside \[0, %d\)" % (bad, world),
               lambda: backend.broadcast([t], opts))
        ropts = dist.ReduceOptions()
        ropts.rootRank = bad
        expect(RuntimeError, r"loom reduce \(rank \d\): root %d is outside" % bad,
               lambda: backend.reduce([t], ropts))
        expect(RuntimeError, r"loom send \(rank \d\): argument 'dst' is %d, outside \[0, %d\); pass a rank"
               % (bad, world), lambda: backend.send([t], bad, 0))
    # A root tensor other than the one tensor of the call (it used to be ignored, as Gloo refuses it).
    for options, call in ((dist.BroadcastOptions(), backend.broadcast), (dist.ReduceOptions(), backend.reduce)):
        options.rootTensor = 3
        expect(RuntimeError, r"loom (broadcast|reduce) \(rank \d\): rootTensor 3 names no tensor of the call",
               lambda: call([t], options))
    # The root's scatter inputs are measured against its output (the message called the output
    # the input); refused on the root before anything is sent, so the others take no part.
    if rank == 0:
        expect(RuntimeError, r"loom scatter \(rank 0\): inputs\[0\] has 3 elements but the output has 4",
               lambda: backend.scatter([t], [[torch.zeros(3)] * world], dist.ScatterOptions()))
    # Sparse and meta tensors, and wrong list lengths at the backend.
    sparse = torch.ones(4).to_sparse()
    expect(RuntimeError, r"loom broadcast \(rank \d\): tensor is not a dense tensor \(layout sparse COO\)",
           lambda: backend.broadcast([sparse], dist.BroadcastOptions()))
    expect(RuntimeError, r"loom all_reduce.*sparse tensors can only be summed",
           lambda: dist.all_reduce(sparse, op=dist.ReduceOp.MAX))
    expect(RuntimeError, r"loom all_gather_into_tensor \(rank \d\): output is on meta",
           lambda: backend._allgather_base(torch.empty(4 * world, device="meta"), t))
    expect(RuntimeError, r"loom all_reduce \(rank \d\): tensors has 2 entries; expected 1 \(loom takes "
           r"one per call: issue one call for each, or group the calls in "
           r"torch.distributed._coalescing_manager\)", lambda: backend.allreduce([t, t.clone()]))
    expect(RuntimeError, r"loom all_reduce \(rank \d\): tensors has 0 entries; expected 1$",
           lambda: backend.allreduce([]))
    # A coalesced call takes several tensors: a count that disagrees gets no such advice.
    expect(RuntimeError, r"each output list has 2 tensor\(s\); expected 1$",
           lambda: backend.allgather_coalesced([[torch.empty(4), torch.empty(4)]] * world, [t]))
    expect(RuntimeError, r"loom all_to_all \(rank \d\): inputs has %d tensors" % (world + 1),
           lambda: backend.alltoall([torch.empty(1)] * world, [torch.ones(1)] * (world + 1)))
    # Undefined-size or non-dtype arguments to reductions.
    expect(ANY_ERROR, r"", lambda: dist.all_reduce(t, op="SUM"))
    expect(RuntimeError, r"dtype UInt16 cannot be reduced by loom",
           lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint16)))
    still_works(world)


def body_right_results(rank: int, world: int) -> None:
    # Empty tensors: every collective completes; nothing to compare but shapes.
    e = torch.empty(0)
    dist.all_reduce(e)
    dist.broadcast(e, src=world - 1)
    dist.reduce(e, dst=0)
    out = torch.empty(0)
    dist.all_gather_into_tensor(out, e)
    dist.reduce_scatter_tensor(out, e)
    dist.all_to_all_single(out, e)
    lst = [torch.empty(0) for _ in range(world)]
    dist.all_gather(lst, e)
    dist.all_to_all(lst, [torch.empty(0) for _ in range(world)])
    dist.gather(e, lst if rank == 0 else None, dst=0)
    dist.scatter(e, lst if rank == 0 else None, src=0)
    if world > 1:
        if rank == 0:
            dist.send(e, dst=1)
        elif rank == 1:
            dist.recv(e, src=0)
    # all_to_all_single with zero-row splits mixed in (rank q sends q rows to every rank).
    send = torch.full((rank * world, 2), float(rank))
    recv = torch.full((sum(range(world)), 2), -1.0)
    dist.all_to_all_single(recv, send, [q for q in range(world)], [rank] * world)
    want = torch.cat([torch.full((q, 2), float(q)) for q in range(world)])
    assert torch.equal(recv, want), (recv, want)
    # Non-contiguous inputs and outputs (a transposed view, a strided slice).
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
    view = base.t()
    dist.all_reduce(view)
    ref = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * sum(range(1, world + 1))
    assert torch.equal(view, ref), view
    holder = torch.zeros(8 * world)
    strided = holder[::2]
    dist.all_gather_into_tensor(strided, torch.full((4,), float(rank)))
    assert torch.equal(strided, torch.arange(world).repeat_interleave(4).float()), strided
    assert torch.equal(holder[1::2], torch.zeros(4 * world))
    still_works(world)


def body_world_of_one(rank: int, world: int) -> None:
    assert world == 1
    x = torch.arange(6, dtype=torch.float32) - 2
    for op, want in ((dist.ReduceOp.SUM, x), (dist.ReduceOp.MAX, x), (dist.ReduceOp.AVG, x),
                     (dist.ReduceOp.PRODUCT, x)):
        t = x.clone()
        dist.all_reduce(t, op=op)
        assert torch.equal(t, want), (op, t)
        t = x.clone()
        dist.reduce(t, dst=0, op=op)
        assert torch.equal(t, want)
    i = torch.tensor([5, 3, 6], dtype=torch.int32)
    t = i.clone()
    dist.all_reduce(t, op=dist.ReduceOp.BAND)
    assert torch.equal(t, i)
    t = x.clone()
    dist.broadcast(t, src=0)
    assert torch.equal(t, x)
    out = torch.empty(6)
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, x)
    out = torch.empty(6)
    dist.reduce_scatter_tensor(out, x)
    assert torch.equal(out, x)
    out = torch.empty(6)
    dist.all_to_all_single(out, x)
    assert torch.equal(out, x)
    lst = [torch.empty(6)]
    dist.all_gather(lst, x)
    assert torch.equal(lst[0], x)
    lst = [torch.empty(6)]
    dist.all_to_all(lst, [x.clone()])
    assert torch.equal(lst[0], x)
    lst = [torch.empty(6)]
    dist.gather(x, lst, dst=0)
    assert torch.equal(lst[0], x)
    t = torch.empty(6)
    dist.scatter(t, [x.clone()], src=0)
    assert torch.equal(t, x)
    t = torch.empty(6)
    dist.reduce_scatter(t, [x.clone()])
    assert torch.equal(t, x)
    objs = [None]
    dist.all_gather_object(objs, {"r": rank})
    assert objs == [{"r": 0}]
    dist.barrier()
    # A rank out of range is still refused in a world of one.
    expect(ANY_ERROR, r"rank|root|src|dst|group", lambda: dist.broadcast(x, src=1))
    still_works(world)


def body_process_group_arguments(rank: int, world: int) -> None:
    import loom

    assert loom.is_available()
    store = dist.distributed_c10d._get_default_store()
    t = timedelta(seconds=30)
    # Wrong types: pybind refuses them.
    expect(TypeError, r"incompatible|argument", lambda: loom.ProcessGroupLoom(store, "0", 1, t))
    expect(TypeError, r"incompatible|argument", lambda: loom.ProcessGroupLoom(store, 0, 1, "soon"))
    # Out-of-range rank and size, a non-positive timeout: loom's create refuses them.
    expect(RuntimeError, r"loom create.*'rank' is -1", lambda: loom.ProcessGroupLoom(store, -1, 2, t))
    expect(RuntimeError, r"loom create.*'rank' is 2", lambda: loom.ProcessGroupLoom(store, 2, 2, t))
    expect(RuntimeError, r"loom create.*'size' is 0", lambda: loom.ProcessGroupLoom(store, 0, 0, t))
    expect(RuntimeError, r"loom create.*timeout must be positive",
           lambda: loom.ProcessGroupLoom(store, 0, 1, timedelta(0)))
    expect(RuntimeError, r"loom create.*timeout must be positive",
           lambda: loom.ProcessGroupLoom(store, 0, 1, timedelta(seconds=-1)))
    assert isinstance(loom._C.kernel_isa(), str)
    still_works(world)


def body_sparse_disagreement(rank: int, world: int) -> None:
    """Ranks whose sparse tensors differ in shape or dtype all get an error naming both,
    never a sum of rows that do not fit (Gloo refuses them too)."""
    shaped = torch.sparse_coo_tensor([[0], [0]], [1.0], (2, 2 + rank))
    expect(RuntimeError, r"loom all_reduce \(sparse\) \(rank \d\): rank \d passed a sparse tensor "
           r"Float of shape \[2, \d\].*where rank 0 passed Float of shape \[2, 2\]",
           lambda: dist.all_reduce(shaped))
    typed = torch.sparse_coo_tensor([[0], [0]], [1.0], (2, 2),
                                    dtype=torch.float32 if rank == 0 else torch.float64)
    expect(RuntimeError, r"rank \d passed a sparse tensor Double .* where rank 0 passed Float",
           lambda: dist.all_reduce(typed))
    # Agreeing ranks still sum.
    same = torch.sparse_coo_tensor([[rank], [0]], [1.0], (world, 2))
    dist.all_reduce(same)
    assert torch.equal(same.to_dense()[:, 0], torch.ones(world)), same
    still_works(world)


def body_overlapping_into_tensor(rank: int, world: int) -> None:
    """An input that overlaps the output other than as the rank's own block is read as it
    was (as Gloo does), on every rank: not refused on some ranks while the others wait."""
    out = torch.full((world * 3,), -1.0)
    first = out.narrow(0, 0, 3)
    first.fill_(rank + 1.0)  # every rank's input is block 0 of its output
    dist.all_gather_into_tensor(out, first)
    assert out.tolist() == [float(q + 1) for q in range(world) for _ in range(3)], out
    data = torch.arange(world * 2, dtype=torch.float32) + rank
    expected = sum(torch.arange(world * 2, dtype=torch.float32) + q for q in range(world))
    block0 = data.narrow(0, 0, 2)  # every rank's output is block 0 of its input
    dist.reduce_scatter_tensor(block0, data)
    assert block0.tolist() == expected[rank * 2:rank * 2 + 2].tolist(), block0
    # The same through the direct entry.
    import loom.ops  # noqa: F401  (registers torch.ops.loom)

    group = dist.group.WORLD.group_name
    out = torch.full((world * 3,), -1.0)
    out.narrow(0, 0, 3).fill_(rank + 1.0)
    torch.ops.loom.all_gather_into_tensor_out(out.narrow(0, 0, 3), world, group, out=out)
    assert out.tolist() == [float(q + 1) for q in range(world) for _ in range(3)], out
    # Across the pairs of a coalesced call: the second pair's input lies in the first pair's
    # output, which the engine writes first; it is read as it was before the call.
    first_out = torch.full((world * 2,), -1.0)
    second_in = first_out.narrow(0, 0, 2)
    second_in.fill_(10.0 + rank)
    second_out = torch.empty(world * 2)
    first_in = torch.full((2,), float(rank))
    opts = torch._C._distributed_c10d.AllgatherOptions()
    dist.group.WORLD.allgather_into_tensor_coalesced([first_out, second_out], [first_in, second_in],
                                                      opts).wait()
    assert first_out.tolist() == [float(q) for q in range(world) for _ in range(2)], first_out
    assert second_out.tolist() == [10.0 + q for q in range(world) for _ in range(2)], second_out
    rs_first_in = torch.ones(world * 2)
    rs_second_in = torch.full((world * 2,), float(rank + 1))
    rs_first_out_view = rs_second_in.narrow(0, 0, 2)  # the second input holds the first output
    rs_second_out = torch.empty(2)
    ropts = torch._C._distributed_c10d.ReduceScatterOptions()
    dist.group.WORLD.reduce_scatter_tensor_coalesced([rs_first_out_view, rs_second_out],
                                                     [rs_first_in, rs_second_in], ropts).wait()
    assert rs_first_out_view.tolist() == [float(world)] * 2, rs_first_out_view
    assert rs_second_out.tolist() == [float(world * (world + 1) // 2)] * 2, rs_second_out
    still_works(world)


def body_overlapping_lists(rank: int, world: int) -> None:
    """The list forms (and all_to_all_single) with inputs that overlap outputs other than in place, and outputs that
    overlap each other: every input is read as it was before the call and outputs are written
    in rank order, on every rank (the engine alone would refuse on the ranks where they
    overlap, a gather's and a scatter's only on the root, leaving the others waiting). Gloo
    differs here: it reads some inputs after writing outputs over them."""
    # all_gather into a list whose last entry is this rank's input.
    outs = [torch.full((2,), -1.0) for _ in range(world)]
    outs[-1].fill_(rank + 1.0)
    dist.all_gather(outs, outs[-1])
    assert [t.tolist() for t in outs] == [[q + 1.0] * 2 for q in range(world)], outs
    # The same output for every rank: the last rank's block is written last.
    twice = torch.full((2,), -1.0)
    dist.all_gather([twice] * world, torch.full((2,), rank + 1.0))
    assert twice.tolist() == [float(world)] * 2, twice
    # Outputs that overlap though one is strided: rank 1's block lands last where they meet.
    base = torch.full((4,), -1.0)
    outs = [base[::2], base[0:2]] + [torch.empty(2) for _ in range(world - 2)]
    dist.all_gather(outs, torch.full((2,), rank + 1.0))
    assert base.tolist() == [2.0, 2.0, 1.0, -1.0], base
    # gather: the root's input is its outputs[1].
    outs = [torch.full((3,), -1.0) for _ in range(world)]
    outs[1].fill_(10.0 + rank)
    dist.gather(outs[1], outs if rank == 0 else None, dst=0)
    if rank == 0:
        assert [t.tolist() for t in outs] == [[10.0 + q] * 3 for q in range(world)], outs
    # reduce_scatter: the output is another rank's block of the input.
    ins = [torch.full((2,), float(rank + q)) for q in range(world)]
    out = ins[(rank + 1) % world]
    dist.reduce_scatter(out, ins)
    assert out.tolist() == [float(sum(q + rank for q in range(world)))] * 2, out
    # scatter: the root's output is its inputs[1], sent to rank 1 as it was.
    ins = [torch.full((2,), 100.0 + q) for q in range(world)]
    out = ins[1] if rank == 0 else torch.empty(2)
    dist.scatter(out, ins if rank == 0 else None, src=0)
    assert out.tolist() == [100.0 + rank] * 2, out
    # all_to_all into one tensor repeated ([t] * world): the last rank's block lands last;
    # and an input that is another pair's output is sent as it was.
    twice = torch.full((2,), -1.0)
    dist.all_to_all([twice] * world, [torch.full((2,), 10.0 * rank + q) for q in range(world)])
    assert twice.tolist() == [10.0 * (world - 1) + rank] * 2, twice
    outs = [torch.full((2,), -1.0) for _ in range(world)]
    ins = [torch.full((2,), 10.0 * rank + q) for q in range(world)]
    ins[0] = outs[world - 1]
    ins[0].fill_(10.0 * rank)
    dist.all_to_all(outs, ins)
    assert [t.tolist() for t in outs] == [[10.0 * q + rank] * 2 for q in range(world)], outs
    # all_gather_coalesced whose second input is where the first pair writes rank 1's input:
    # gathered as it was (the pairs run one after another; it was read once overwritten).
    outs = [[torch.zeros(2), torch.zeros(2)] for _ in range(world)]
    second = outs[1][0]
    second.fill_(100.0 + rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # all_gather_coalesced is deprecated, not gone
        dist.all_gather_coalesced(outs, [torch.full((2,), rank + 1.0), second])
    assert [o[1].tolist() for o in outs] == [[100.0 + q] * 2 for q in range(world)], outs
    assert [o[0].tolist() for o in outs] == [[q + 1.0] * 2 for q in range(world)], outs
    # all_to_all_single whose output starts inside its input (on rank 0 only), equal blocks
    # and with split sizes, through c10d and the direct entry: the input is sent as it was.
    import loom.ops  # noqa: F401  (registers torch.ops.loom)

    for entry in ("c10d", "splits", "direct"):
        buf = torch.arange(world * 3, dtype=torch.float32) + 100 * rank
        expected_in = buf[0:2 * world].clone()
        inp = buf[0:2 * world]
        out = buf[2:2 + 2 * world] if rank == 0 else torch.empty(2 * world)
        if entry == "c10d":
            dist.all_to_all_single(out, inp)
        elif entry == "splits":
            dist.all_to_all_single(out, inp, [2] * world, [2] * world)
        else:
            torch.ops.loom.all_to_all_single_out(inp, [], [], dist.group.WORLD.group_name, out=out)
        want = [100.0 * q + 2 * rank + i for q in range(world) for i in range(2)]
        assert out.tolist() == want, (entry, out.tolist(), want, expected_in.tolist())
    still_works(world)


@pytest.mark.parametrize("world", [2, 3])
def test_list_forms_with_overlapping_tensors_read_inputs_as_they_were(world):
    run_ranks(world, body_overlapping_lists)


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_all_reduce_refuses_ranks_that_disagree(world):
    run_ranks(world, body_sparse_disagreement)


@pytest.mark.parametrize("world", [2, 3])
def test_inputs_overlapping_outputs_are_read_as_they_were(world):
    run_ranks(world, body_overlapping_into_tensor)


@pytest.mark.parametrize("world", [2, 3])
def test_wrong_arguments_are_refused(world):
    run_ranks(world, body_wrong_arguments)


@pytest.mark.parametrize("world", [2, 3])
def test_empty_and_non_contiguous_tensors_give_right_results(world):
    run_ranks(world, body_right_results)


def test_world_of_one_gives_right_results():
    run_ranks(1, body_world_of_one)


def test_process_group_constructor_arguments():
    run_ranks(2, body_process_group_arguments)


def body_null_store(rank: int, world: int) -> None:
    import loom

    expect(TypeError, r"incompatible|store", lambda: loom.ProcessGroupLoom(None, 0, 1, timedelta(seconds=30)))
    still_works(world)


def test_process_group_refuses_a_null_store():
    run_ranks(1, body_null_store)



def body_outputs_sharing_memory(rank: int, world: int):
    """A written tensor whose elements share memory (expand()) is refused at the call, naming
    it: its copy-back used to fail with torch's message after the call had run on every rank
    (a receive had taken its message). A broadcast root's tensor is only read: it may be one."""
    refusals = []
    shared = torch.zeros(1).expand(2 * world)
    for name, call in (("all_reduce", lambda: dist.all_reduce(shared)),
                       ("all_gather_into_tensor",
                        lambda: dist.all_gather_into_tensor(shared, torch.ones(2)))):
        try:
            call()
            refusals.append(f"{name} accepted")
        except RuntimeError as e:
            refusals.append(str(e).splitlines()[0])
    if rank == 0:
        try:
            dist.recv(torch.zeros(1).expand(2), 1)
            refusals.append("recv accepted")
        except RuntimeError as e:
            refusals.append(str(e).splitlines()[0])
        got = torch.zeros(2)
        dist.recv(got, 1)  # the message the refused receive never took
        assert got.tolist() == [1.0, 1.0], got
    else:
        dist.send(torch.ones(2), 0)
    root_tensor = torch.full((1,), 7.0).expand(4) if rank == 0 else torch.zeros(4)
    dist.broadcast(root_tensor, 0)
    return refusals, root_tensor.tolist()


def test_outputs_whose_elements_share_memory_are_refused_at_the_call():
    for rank, (refusals, received) in enumerate(run_ranks(2, body_outputs_sharing_memory)):
        assert received == [7.0] * 4, received
        assert len(refusals) == (3 if rank == 0 else 2), refusals
        for message in refusals:
            assert "elements that share memory" in message and f"(rank {rank})" in message, message
