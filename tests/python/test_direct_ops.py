"""torch.ops.loom.*, the direct entry (python/loom/ops.py, torch_plugin/direct_ops.cc), and
loom.ops.*, the same kernels called eagerly without torch's dispatcher: every operator
against the torch.distributed call on the same group and a reference, on the direct path
(contiguous CPU tensors) and the staged one (non-contiguous, complex), through both
entries; ordering behind queued asynchronous calls; torch.compile tracing both; and clear
errors for a wrong group name, a group that is not loom's, a bad reduce_op or group_size,
each naming the entry the caller used."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

WORLD = 3
# The two spellings of the direct entry: the torch operators and loom.ops's eager functions.
ENTRIES = ("torch.ops.loom", "loom.ops")


def entry_ops(entry: str):
    """The namespace whose six functions the test calls."""
    import loom.ops

    return torch.ops.loom if entry == "torch.ops.loom" else loom.ops


def value(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s data: small integers, exact in every dtype and under every op."""
    base = (torch.arange(n) * 7 + rank * 3) % 5 + 1
    if dtype.is_complex:
        return torch.complex(base.double(), -base.double()).to(dtype)
    return base.to(dtype)


def ops_body(rank: int, world: int, entry: str) -> None:
    ops = entry_ops(entry)
    name = dist.group.WORLD.group_name
    cases = [(torch.float32, "sum", dist.ReduceOp.SUM), (torch.bfloat16, "max", dist.ReduceOp.MAX),
             (torch.int64, "bxor", dist.ReduceOp.BXOR), (torch.float64, "avg", dist.ReduceOp.AVG),
             (torch.int32, "product", dist.ReduceOp.PRODUCT), (torch.complex64, "sum", dist.ReduceOp.SUM)]
    for n in (1, 37, 70000):
        for dtype, op_name, op in cases:
            if op is dist.ReduceOp.AVG and not dtype.is_floating_point:
                continue
            mine = value(rank, n, dtype)
            want = mine.clone()
            dist.all_reduce(want, op=op)
            # In place, on the direct path and on a strided view (staged).
            got = mine.clone()
            assert ops.all_reduce_(got, op_name, name) is None
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            wide = torch.zeros(n, 2, dtype=dtype)
            wide[:, 0] = mine
            ops.all_reduce_(wide[:, 0], op_name.upper(), name)
            torch.testing.assert_close(wide[:, 0], want, rtol=0, atol=0)
            assert not wide[:, 1].any(), "the staged path wrote outside the view"
            # Out of place: the input is untouched.
            got = ops.all_reduce(mine, op_name, name)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            torch.testing.assert_close(mine, value(rank, n, dtype), rtol=0, atol=0)
        x = value(rank, n, torch.float32)
        # broadcast_ from every root, direct and staged.
        for root in range(world):
            t = x.clone()
            ops.broadcast_(t, root, name)
            torch.testing.assert_close(t, value(root, n, torch.float32), rtol=0, atol=0)
            t = torch.zeros(2, n)
            t[1] = x
            ops.broadcast_(t[:, :].t()[:, 1], root, name)
            torch.testing.assert_close(t[1], value(root, n, torch.float32), rtol=0, atol=0)
        # all_gather_into_tensor and reduce_scatter_tensor, 2-D (rows gathered).
        rows = x.reshape(n, 1).expand(n, 2).contiguous()
        g = ops.all_gather_into_tensor(rows, world, name)
        assert g.shape == (world * n, 2)
        torch.testing.assert_close(g, torch.cat([value(q, n, torch.float32).reshape(n, 1).expand(n, 2)
                                                 for q in range(world)]), rtol=0, atol=0)
        whole = value(rank, world * n, torch.float32)
        r = ops.reduce_scatter_tensor(whole, "sum", world, name)
        want = torch.empty(n)
        dist.reduce_scatter_tensor(want, whole)
        torch.testing.assert_close(r, want, rtol=0, atol=0)
        # all_to_all_single: equal splits, then uneven ones (rank q sends q + 1 rows to each).
        a = ops.all_to_all_single(whole, [], [], name)
        want_a = torch.empty_like(whole)
        dist.all_to_all_single(want_a, whole)
        torch.testing.assert_close(a, want_a, rtol=0, atol=0)
        # The *_out forms, into the caller's tensors: contiguous (direct), strided (staged),
        # and the gather in place (the input is this rank's block of out).
        gathered = torch.cat([value(q, n, torch.float32) for q in range(world)])
        out = torch.full((world * n,), -1.0)
        back = ops.all_gather_into_tensor_out(x, world, name, out=out)
        assert back is (out if entry == "loom.ops" else None)
        torch.testing.assert_close(out, gathered, rtol=0, atol=0)
        strided = torch.zeros(world * n, 2)
        ops.all_gather_into_tensor_out(x, world, name, out=strided[:, 1])
        torch.testing.assert_close(strided[:, 1], gathered, rtol=0, atol=0)
        assert not strided[:, 0].any(), "the staged path wrote outside the view"
        out = torch.zeros(world * n)
        mine = out[rank * n:(rank + 1) * n]
        mine.copy_(x)
        ops.all_gather_into_tensor_out(mine, world, name, out=out)
        torch.testing.assert_close(out, gathered, rtol=0, atol=0)
        out = torch.full((n,), -1.0)
        ops.reduce_scatter_tensor_out(whole, "sum", world, name, out=out)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        strided = torch.zeros(n, 2)
        ops.reduce_scatter_tensor_out(whole, "sum", world, name, out=strided[:, 0])
        torch.testing.assert_close(strided[:, 0], want, rtol=0, atol=0)
        out = torch.full_like(whole, -1.0)
        ops.all_to_all_single_out(whole, [], [], name, out=out)
        torch.testing.assert_close(out, want_a, rtol=0, atol=0)
        strided = torch.zeros(world * n, 2)
        ops.all_to_all_single_out(whole, [], [], name, out=strided[:, 1])
        torch.testing.assert_close(strided[:, 1], want_a, rtol=0, atol=0)
        assert not strided[:, 0].any(), "the staged path wrote outside the view"
        in_place = whole.clone()
        ops.all_to_all_single_out(in_place, [], [], name, out=in_place)
        torch.testing.assert_close(in_place, want_a, rtol=0, atol=0)
    # The _out form takes its block's size from out, as torch's functional form and
    # dist.reduce_scatter_tensor do: rows that do not divide among the ranks are fine where
    # the elements do.
    k = 2 * world + 1
    whole = torch.arange(world * k, dtype=torch.float32).reshape(k, world) + rank
    out = torch.full((k,), -1.0)
    ops.reduce_scatter_tensor_out(whole, "sum", world, name, out=out)
    by_dist = torch.empty(k)
    dist.reduce_scatter_tensor(by_dist, whole)
    want = world * torch.arange(rank * k, (rank + 1) * k, dtype=torch.float32) + sum(range(world))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(by_dist, want, rtol=0, atol=0)
    src = torch.full((world * (rank + 1),), float(rank))
    got = ops.all_to_all_single(src, [q + 1 for q in range(world)], [rank + 1] * world, name)
    torch.testing.assert_close(got, torch.cat([torch.full((q + 1,), float(q)) for q in range(world)]))
    out = torch.empty(sum(q + 1 for q in range(world)))
    ops.all_to_all_single_out(src, [q + 1 for q in range(world)], [rank + 1] * world, name, out=out)
    torch.testing.assert_close(out, got, rtol=0, atol=0)


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_op_equals_torch_distributed(entry):
    run_ranks(WORLD, ops_body, entry)


def order_body(rank: int, world: int) -> None:
    # A direct call issued while asynchronous c10d calls are queued runs after them.
    name = dist.group.WORLD.group_name
    big = [torch.full((1 << 18,), float(rank + i)) for i in range(4)]
    works = [dist.all_reduce(b, async_op=True) for b in big]
    small = torch.tensor([float(rank)])
    torch.ops.loom.all_reduce_(small, "sum", name)
    for w in works:
        w.wait()
    total = sum(range(world))
    assert small.item() == total
    for i, b in enumerate(big):
        assert torch.all(b == total + world * i)
    # On a subgroup by its own name.
    sub = dist.new_group([0, 2])
    if rank in (0, 2):
        t = torch.tensor([float(rank)])
        torch.ops.loom.all_reduce_(t, "sum", sub.group_name)
        assert t.item() == 2.0


def test_direct_calls_keep_issue_order_and_work_on_subgroups():
    run_ranks(WORLD, order_body)


def copy_follows_body(rank: int, world: int, on_new_thread: bool) -> list[float]:
    # An input the direct entry copies at issue (it overlaps the output) holds what this
    # group's earlier asynchronous calls write into it, as for the c10d call: also on a thread
    # that never made a c10d call (the copy then asked no group), and after a call on another
    # group (it asked that one).
    name = dist.group.WORLD.group_name
    other = dist.new_group(list(range(world)))
    m, k = 4, 2 * 4 + 1
    flat = torch.zeros(2 * m + world * k)
    col = flat[:2 * m].view(m, 2)[:, 0]  # strided: staged, written back as its call ends
    col.fill_(rank + 1)
    if rank == 1:
        time.sleep(1)  # rank 0's call waits for it
    work = dist.all_reduce(col, async_op=True)
    # This thread's last c10d call: another group's (issued, not waited for).
    elsewhere = None if on_new_thread else dist.all_reduce(torch.zeros(1), group=other, async_op=True)
    inp, out = flat[:k], flat[2 * m:2 * m + world * k]  # they share flat[2m]
    failures = []

    def gather():
        try:
            torch.ops.loom.all_gather_into_tensor_out(inp, world, name, out=out)
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(e)

    if on_new_thread:
        thread = threading.Thread(target=gather)
        thread.start()
        thread.join()
    else:
        gather()
    work.wait()
    if elsewhere is not None:
        elsewhere.wait()
    assert not failures, failures
    return out.tolist()


@pytest.mark.parametrize("on_new_thread", [True, False])
def test_a_copy_taken_at_issue_waits_for_the_groups_earlier_calls(on_new_thread):
    want = ([3.0, 0.0] * 4 + [0.0]) * 2
    for got in run_ranks(2, copy_follows_body, on_new_thread):
        assert got == want, got


def staged_copy_body(rank: int, world: int, case: str, entry: str) -> list:
    # Inputs the direct entry copies at issue of its own (a complex or strided input staged
    # by all_reduce, a negative or conjugate view resolved) hold what this group's earlier
    # asynchronous call writes into them: they read its input before it ran (4 or 3, not 6).
    ops = entry_ops(entry)
    name = dist.group.WORLD.group_name
    if case == "complex":
        x = torch.full((4,), complex(rank + 1, 0), dtype=torch.complex64)
        read = x
    elif case == "strided":
        x = torch.zeros(4, 2)
        x[:, 0] = rank + 1
        read = x[:, 0]
    elif case == "neg":
        x = torch.full((4,), float(rank + 1))
        read = torch._neg_view(x)
    else:  # conj, written in place
        x = torch.full((4,), complex(rank + 1, rank + 1), dtype=torch.complex64)
        read = x.conj()
    if rank == 1:
        time.sleep(1.0)  # rank 0's asynchronous call still waits as its direct call is issued
    work = dist.all_reduce(x, async_op=True)  # x becomes 3 (3+3j) on both ranks
    if case == "conj":
        ops.all_reduce_(read, "sum", name)
        work.wait()
        return x.tolist()
    got = ops.all_reduce(read, "sum", name)
    work.wait()
    return got.real.tolist() if got.is_complex() else got.tolist()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", ["complex", "strided", "neg", "conj"])
def test_inputs_copied_or_resolved_at_issue_wait_for_the_groups_earlier_calls(case, entry):
    want = {"complex": [6.0] * 4, "strided": [6.0] * 4, "neg": [-6.0] * 4, "conj": [6 + 6j] * 4}[case]
    assert run_ranks(2, staged_copy_body, case, entry) == [want, want]


def math_bit_write_body(rank: int, world: int, kind: str, entry: str):
    ops = entry_ops(entry)
    name = dist.group.WORLD.group_name
    if kind == "inference-neg":
        with torch.inference_mode():
            view = torch._neg_view(torch.full((4,), float(rank + 1)))
    elif kind == "inference-conj":
        with torch.inference_mode():
            view = torch.full((4,), complex(rank + 1, 1), dtype=torch.complex64).conj()
    else:  # an expanded conjugate view: its elements share memory
        view = torch.ones(1, dtype=torch.complex64).expand(4).conj()
    want = view.clone()
    if kind.startswith("inference"):
        dist.all_reduce(want)
    try:
        ops.all_reduce_(view, "sum", name)
    except RuntimeError as e:
        return str(e)
    return torch.equal(view, want)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("kind", ["inference-neg", "inference-conj"])
def test_a_negative_or_conjugate_view_of_an_inference_tensor_is_written(kind, entry):
    # Its result was written back with copy_, which refuses inference tensors outside
    # inference mode: the call ran on every rank, then failed, its result lost.
    assert run_ranks(2, math_bit_write_body, kind, entry) == [True, True]


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_expanded_conjugate_view_to_write_is_refused_before_anything_is_sent(entry):
    # Its resolved copy passed the kernel's check, and torch's copy_ back failed after the
    # call had run on every rank.
    for got in run_ranks(2, math_bit_write_body, "expanded-conj", entry):
        assert "share memory" in got and "all_reduce" in got, got


def math_bit_version_body(rank: int, world: int, entry: str) -> list:
    # A tensor autograd saved, written through a negative or conjugate view: its version
    # moves, so the backward that saved it refuses to run on the new values (the write back
    # went below autograd and left it where it was: backward ran on overwritten values).
    ops = entry_ops(entry)
    name = dist.group.WORLD.group_name
    out = []
    for view_of in (torch._neg_view, torch.conj):
        a = torch.ones(4, dtype=torch.complex64 if view_of is torch.conj else torch.float32,
                       requires_grad=True)
        y = a.exp()
        before = y._version
        with torch.no_grad():
            ops.all_reduce_(view_of(y), "sum", name)
        moved = y._version > before
        try:
            y.abs().sum().backward()
            refused = False
        except RuntimeError as e:
            refused = "modified by an inplace operation" in str(e)
        out.append((moved, refused))
    return out


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_tensor_written_through_a_math_bit_view_is_marked_written(entry):
    for got in run_ranks(2, math_bit_version_body, entry):
        assert got == [(True, True), (True, True)], got


def compiled_body(rank: int, world: int, entry: str) -> None:
    ops = entry_ops(entry)
    name = dist.group.WORLD.group_name

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        ops.all_reduce_(y, "sum", name)
        z = ops.all_gather_into_tensor(y + 1, world, name)
        r = ops.reduce_scatter_tensor(z, "sum", world, name)
        gathered = torch.empty(world * 4)
        ops.all_gather_into_tensor_out(r, world, name, out=gathered)
        ops.reduce_scatter_tensor_out(gathered, "sum", world, name, out=r)
        moved = torch.empty(world * 4)
        ops.all_to_all_single_out(gathered, [], [], name, out=moved)
        return ops.all_reduce(r, "max", name) - 1 + (moved - gathered).abs().sum()

    compiled = torch.compile(step, fullgraph=True)
    x = torch.arange(4, dtype=torch.float32) + rank
    torch.testing.assert_close(compiled(x), step(x))
    y = sum((torch.arange(4, dtype=torch.float32) + q) * 2 for q in range(world))
    torch.testing.assert_close(compiled(x), (y + 1) * world * world - 1)


@pytest.mark.parametrize("entry", ENTRIES)
def test_torch_compile_traces_the_operators(entry):
    run_ranks(WORLD, compiled_body, entry)


def compiled_refusals_body(rank: int, world: int) -> None:
    """A traced call the eager call would refuse fails with the eager message, not an error
    of the tracer nor a result: rows that do not divide among the ranks and a group_size of 0
    (the fake kernels check them), an input that requires grad (refused ahead of every
    kernel, fake ones included: a compiled backward would otherwise treat the collective as
    a constant), and the written forms' Parameters and saved tensors (below)."""
    name = dist.group.WORLD.group_name
    compiled = torch.compile(lambda x: torch.ops.loom.reduce_scatter_tensor(x, "sum", world, name),
                             fullgraph=True)
    for bad in (torch.tensor(1.0), torch.ones(world + 1)):
        with pytest.raises(Exception, match="do not divide evenly among"):
            compiled(bad)
    for call in (lambda x: torch.ops.loom.reduce_scatter_tensor(x, "sum", 0, name),
                 lambda x: torch.ops.loom.all_gather_into_tensor(x, 0, name)):
        with pytest.raises(Exception, match=r"group_size is 0"):
            torch.compile(call, fullgraph=True)(torch.ones(world))
    torch._dynamo.reset()
    for entry in ENTRIES:
        ops = entry_ops(entry)

        def weighted(x):
            return (ops.all_reduce(x, "sum", name) * x).sum()

        x = torch.ones(2, requires_grad=True)
        with pytest.raises(Exception, match=r"requires grad and grad mode is on.*no gradient"):
            torch.compile(weighted, fullgraph=True)(x).backward()
        assert x.grad is None
    # The written forms, traced: a Parameter is refused as in an eager call, and a tensor
    # saved for backward and then written makes the backward refuse, where the compiled
    # backward once read the written values (x.grad 2 where it is 1). aot_eager runs the
    # same autograd trace as inductor without its compiler (and its on-disk cache, which
    # kept graphs traced before this across runs).
    for entry in ENTRIES:
        ops = entry_ops(entry)
        torch._dynamo.reset()
        parameter = torch.nn.Parameter(torch.ones(2))
        with pytest.raises(Exception, match=r"all_reduce_ \(rank \d\): tensor is a leaf that requires grad"):
            torch.compile(lambda p: ops.all_reduce_(p, "sum", name), fullgraph=True,
                          backend="aot_eager")(parameter)
        assert parameter.tolist() == [1.0, 1.0]

        def saved_then_written(x, y):
            z = (x * y).sum()  # saves y for backward
            ops.all_gather_into_tensor_out(torch.ones(1), world, name, out=y[:world])
            return z

        torch._dynamo.reset()
        x = torch.ones(world, requires_grad=True)
        y = torch.full((world,), 2.0)
        with pytest.raises(Exception, match="modified by an inplace operation"):
            torch.compile(saved_then_written, fullgraph=True, backend="aot_eager")(x, y).backward()
        assert x.grad is None


def test_a_traced_call_gets_the_eager_calls_refusal():
    run_ranks(WORLD, compiled_refusals_body)


def errors_body(rank: int, world: int, entry: str) -> None:
    ops = entry_ops(entry)
    name = dist.group.WORLD.group_name
    t = torch.ones(4)
    checks = [
        (lambda: ops.all_reduce_(t, "sum", "no-such-group"),
         rf"all_reduce_ \(rank {rank}\): no process group is named 'no-such-group' in this "
         r"process.*a group this rank is a member of.*on the group's members only"),
        (lambda: ops.all_reduce_(t, "mean", name), "reduce_op 'mean' is not one of"),
        (lambda: ops.all_gather_into_tensor(t, world + 1, name), f"group_size is {world + 1}"),
        (lambda: ops.reduce_scatter_tensor(torch.ones(world + 1), "sum", world, name),
         "do not divide evenly"),
        (lambda: ops.broadcast_(t, world, name), f"src {world} is not a rank"),
        (lambda: ops.all_gather_into_tensor_out(t, world, name, out=torch.empty(4 * world + 1)),
         f"out has {4 * world + 1} elements; it needs"),
        (lambda: ops.all_gather_into_tensor_out(t, world, name, out=torch.empty(4 * world).long()),
         "out is Long but input is Float; give both one dtype"),
        (lambda: ops.reduce_scatter_tensor_out(torch.ones(4 * world), "sum", world, name,
                                               out=torch.empty(5)),
         "input has .* elements; it needs"),
        (lambda: ops.all_to_all_single_out(t, [], [], name, out=torch.empty(4).int()),
         "out has dtype Int but input has Float"),
        # Refused on the group's c10d path, named as the operator called (they named the
        # in-place all_reduce_, and c10d's all_to_all_single).
        (lambda: ops.all_to_all_single_out(torch.ones(world), [], [], name, out=torch.empty(world + 1)),
         rf"all_to_all_single_out \(rank {rank}\): .*without split sizes they must be the same size"),
        # Sparse tensors, which torch's dispatcher sends to no kernel of loom's CPU ones.
        (lambda: ops.all_reduce_(torch.ones(4).to_sparse(), "sum", name),
         rf"all_reduce_ \(rank {rank}\): tensor is not a dense tensor \(layout sparse COO\)"),
        (lambda: ops.all_reduce(torch.ones(2, 2).to_sparse_csr(), "sum", name),
         rf"all_reduce \(rank {rank}\): input is not a dense tensor \(layout sparse CSR\)"),
        (lambda: ops.all_gather_into_tensor_out(t, world, name, out=torch.zeros(4 * world).to_sparse()),
         rf"all_gather_into_tensor_out \(rank {rank}\): out is not a dense tensor"),
        (lambda: ops.all_reduce(torch.ones(4, 2).t(), "band", name),
         rf"loom all_reduce \(rank {rank}\): .*band|loom all_reduce \(rank {rank}\): .*BAND"),
        (lambda: ops.all_to_all_single(torch.ones(world + 1), [], [], name), "do not divide evenly"),
    ]
    gloo = dist.new_group(backend="gloo")
    checks.append((lambda: ops.all_reduce_(t, "sum", gloo.group_name),
                   rf"all_reduce_ \(rank {rank}\): process group .* not loom"))
    for call, words in checks:
        with pytest.raises(RuntimeError, match=words) as caught:
            call()
        assert entry in str(caught.value) or f"(rank {rank})" in str(caught.value)
        assert entry == "torch.ops.loom" or "torch.ops.loom" not in str(caught.value)
    if entry == "loom.ops":
        # The usual slips of a caller of torch's functional collectives, named (they were
        # the eager function's argument conversion error, naming loom's internals).
        with pytest.raises(TypeError, match=r"loom.ops.all_reduce_: group_name must be a str.*"
                                            r"not ProcessGroup \(pass its .group_name\)"):
            ops.all_reduce_(t, "sum", dist.group.WORLD)
        with pytest.raises(TypeError, match=r"loom.ops.reduce_scatter_tensor: reduce_op must be a "
                                            r"str, one of sum, avg.*not (RedOpType|ReduceOp)"):
            ops.reduce_scatter_tensor(torch.ones(4 * world), dist.ReduceOp.SUM, world, name)
    # The group still works after the refusals.
    ops.all_reduce_(t, "sum", name)
    assert torch.all(t == world)


@pytest.mark.parametrize("entry", ENTRIES)
def test_bad_arguments_are_named_errors(entry):
    run_ranks(WORLD, errors_body, entry)


def autograd_body(rank: int, world: int, entry: str) -> None:
    """The operators have no gradient: an input autograd would differentiate through one that
    returns a new tensor is refused, naming what to use instead (under no_grad it runs); a
    leaf that requires grad is not written in place, as copy_ refuses; other tensors that
    require grad (gradients of create_graph=True, averaged in a hook) and inference tensors
    are written; and a tensor written in place is seen by autograd as written, as after
    copy_, so a backward that saved it refuses to run instead of using the new values."""
    ops = entry_ops(entry)
    name = dist.group.WORLD.group_name
    leaf = torch.ones(4, requires_grad=True)
    for call in (lambda: ops.all_reduce(leaf, "sum", name),
                 lambda: ops.all_gather_into_tensor(leaf, world, name),
                 lambda: ops.reduce_scatter_tensor(torch.ones(world, requires_grad=True), "sum", world, name),
                 lambda: ops.all_to_all_single(torch.ones(world, requires_grad=True), [], [], name)):
        with pytest.raises(RuntimeError, match=r"requires grad and grad mode is on.*no gradient.*"
                                               r"torch.no_grad\(\).*_functional_collectives"):
            call()
    for call in (lambda: ops.all_reduce_(leaf, "sum", name), lambda: ops.broadcast_(leaf[:2], 0, name),
                 lambda: ops.all_gather_into_tensor_out(torch.ones(4), world, name,
                                                        out=torch.zeros(4 * world, requires_grad=True))):
        with pytest.raises(RuntimeError, match=r"is a leaf that requires grad.*torch.no_grad\(\)"):
            call()
    # A negative view of one: refused by loom before anything is sent, never by the write
    # back after the collective ran (loom.ops once, torch's fallback for negative views once).
    with pytest.raises(RuntimeError, match=r"is a leaf that requires grad.*torch.no_grad\(\)"):
        ops.all_reduce_(torch._neg_view(leaf), "sum", name)
    with torch.no_grad():
        assert torch.equal(ops.all_reduce(leaf, "sum", name), torch.full((4,), float(world)))
        ops.all_reduce_(leaf, "sum", name)
    assert torch.equal(leaf.detach(), torch.full((4,), float(world))) and leaf.requires_grad
    # A gradient made with create_graph=True (it requires grad, grad mode on) is averaged.
    g = torch.ones(4, requires_grad=True) * (rank + 1)
    ops.all_reduce_(g, "avg", name)
    assert torch.equal(g.detach(), torch.full((4,), (world + 1) / 2))
    # An inference tensor, written outside inference mode (it has no version to bump).
    with torch.inference_mode():
        frozen = torch.ones(4)
    ops.all_reduce_(frozen, "sum", name)
    assert torch.equal(frozen, torch.full((4,), float(world)))
    # Saved for backward, then written in place by each in-place form.
    writes = (lambda w: ops.all_reduce_(w, "sum", name), lambda w: ops.broadcast_(w, 0, name),
              lambda w: ops.all_gather_into_tensor_out(torch.ones(1), world, name, out=w[:world]),
              lambda w: ops.reduce_scatter_tensor_out(torch.ones(world), "sum", world, name, out=w[:1]),
              lambda w: ops.all_to_all_single_out(torch.ones(world), [], [], name, out=w[:world]))
    for write in writes:
        x = torch.ones(4, requires_grad=True)
        w = torch.full((4,), 2.0)
        y = (x * w).sum()
        before = w._version
        write(w)
        assert w._version > before, "the write did not bump the version"
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()


@pytest.mark.parametrize("entry", ENTRIES)
def test_the_operators_refuse_gradients_and_mark_what_they_write(entry):
    run_ranks(WORLD, autograd_body, entry)


def negative_views_body(rank: int, world: int) -> None:
    """Tensors carrying torch's lazy negation bit (their memory holds the values unnegated):
    both entries read and write them as the values they stand for, as torch.distributed
    does (the eager entry skips the dispatcher, which resolves them for the operator)."""
    name = dist.group.WORLD.group_name
    base = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)

    def negative():  # contiguous, values -(rank+1) * [1, 2, 3], stored as +(rank+1) * [1, 2, 3]
        t = torch._neg_view(base)
        assert t.is_neg() and t.is_contiguous()
        return t

    want_max = -torch.tensor([1.0, 2.0, 3.0])
    want_gather = torch.cat([-torch.tensor([1.0, 2.0, 3.0]) * (r + 1) for r in range(world)])
    for entry in ENTRIES:
        ops = entry_ops(entry)
        torch.testing.assert_close(ops.all_reduce(negative(), "max", name), want_max)
        torch.testing.assert_close(ops.all_gather_into_tensor(negative(), world, name), want_gather)
        into = negative()
        ops.all_reduce_(into, "max", name)  # written back through the view
        torch.testing.assert_close(into.clone(), want_max)
        torch.testing.assert_close(base, -want_max)  # the memory under the view
        base = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)


def test_negative_views_are_read_and_written_as_their_values():
    run_ranks(2, negative_views_body)


def written_views_body(rank: int, world: int) -> None:
    """Every form that writes a tensor, into a negative and into a conjugate view, through
    both entries: the values torch.distributed writes. (Through torch's dispatcher its own
    fallback for these views expects a written tensor to be returned, which these forms do
    not do; it read past the stack and crashed the process.)"""
    name = dist.group.WORLD.group_name
    for bit, dtype in (("neg", torch.float32), ("conj", torch.complex64)):
        def view(t):
            return torch._neg_view(t) if bit == "neg" else t.conj()

        x = value(rank, 2 * world, dtype)
        for entry in ENTRIES:
            ops = entry_ops(entry)
            cases = {
                "all_reduce_": (lambda out: ops.all_reduce_(out, "sum", name),
                                lambda want: dist.all_reduce(want), x.clone()),
                "broadcast_": (lambda out: ops.broadcast_(out, 1, name),
                               lambda want: dist.broadcast(want, 1), x.clone()),
                "all_gather_into_tensor_out": (
                    lambda out: ops.all_gather_into_tensor_out(x, world, name, out=out),
                    lambda want: dist.all_gather_into_tensor(want, x),
                    torch.zeros(2 * world * world, dtype=dtype)),
                "reduce_scatter_tensor_out": (
                    lambda out: ops.reduce_scatter_tensor_out(x, "sum", world, name, out=out),
                    lambda want: dist.reduce_scatter_tensor(want, x), torch.zeros(2, dtype=dtype)),
                "all_to_all_single_out": (
                    lambda out: ops.all_to_all_single_out(x, [], [], name, out=out),
                    lambda want: dist.all_to_all_single(want, x), torch.zeros(2 * world, dtype=dtype)),
            }
            for op, (call, reference, start) in cases.items():
                for _ in range(20):  # the crash needed a few calls to show on some forms
                    out = view(start.clone())
                    want = out.clone()  # a plain tensor of the view's values
                    reference(want)
                    call(out)
                    torch.testing.assert_close(out.clone(), want, rtol=0, atol=0,
                                               msg=lambda m: f"{entry} {op} into a {bit} view: {m}")


def test_every_written_form_takes_negative_and_conjugate_views():
    run_ranks(2, written_views_body)


def recorded_body(rank: int, world: int) -> dict:
    """What records or transforms operators sees loom.ops's eager functions as the operators:
    torch.jit.trace (which sees only what reaches torch's dispatcher: skipped, the trace left
    the collective out and returned uninitialised memory), vmap and functionalize."""
    import loom.ops

    name = dist.group.WORLD.group_name
    got = {}
    for entry in ENTRIES:
        ops = entry_ops(entry)

        def step(x):
            return ops.all_reduce(x * 1, "sum", name) + 0

        traced = torch.jit.trace(step, torch.ones(2))
        kinds = [node.kind() for node in traced.graph.nodes()]
        assert "loom::all_reduce" in kinds, (entry, kinds)
        got[entry, "trace"] = traced(torch.full((2,), float(rank + 1))).tolist()
        batch = torch.arange(6.0).reshape(3, 2) + 10 * rank
        got[entry, "vmap"] = torch.vmap(lambda row: ops.all_reduce(row, "sum", name))(batch).tolist()
        got[entry, "functionalize"] = torch.func.functionalize(
            lambda b: ops.all_reduce(b * 1, "sum", name))(batch).tolist()
    assert loom.ops is entry_ops("loom.ops")
    return got


def test_traces_and_transforms_see_the_eager_functions_as_operators():
    got = run_ranks(2, recorded_body)
    assert got[0] == got[1]
    pairs = [[10.0, 12.0], [14.0, 16.0], [18.0, 20.0]]
    for entry in ENTRIES:
        assert got[0][entry, "trace"] == [3.0, 3.0]
        assert got[0][entry, "vmap"] == got[0][entry, "functionalize"] == pairs, got[0]


def make_fx_body(rank: int, world: int) -> None:
    """make_fx records loom.ops's functions as the operators (it sets no compiling flag,
    but runs under a dispatch mode), and the traced graph replays the collective."""
    import loom.ops
    from torch.fx.experimental.proxy_tensor import make_fx

    name = dist.group.WORLD.group_name

    def step(x):
        return loom.ops.all_reduce(x * 2, "sum", name) + 1

    for mode in ("real", "fake", "symbolic"):
        graph = make_fx(step, tracing_mode=mode)(torch.ones(4))
        targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
        assert "loom.all_reduce.default" in targets, (mode, targets)
        got = graph(torch.full((4,), float(rank + 1)))
        torch.testing.assert_close(got, torch.full((4,), 2.0 * world * (world + 1) / 2 + 1))


def test_make_fx_records_the_eager_functions_as_operators():
    run_ranks(2, make_fx_body)


def symbolic_trace_and_meta_body(rank: int, world: int) -> None:
    """torch.fx.symbolic_trace records loom.ops's functions as the operators (its proxies are
    no tensors: the eager functions refused them with a TypeError), and the graph replays
    the collectives; on meta tensors they give the fake kernels' shapes (they asked the group
    for a meta backend, and told the user to make one)."""
    import loom.ops

    name = dist.group.WORLD.group_name

    class Step(torch.nn.Module):
        def forward(self, x):
            gathered = torch.zeros(world * 4)
            loom.ops.all_gather_into_tensor_out(x, world, name, out=gathered)
            return loom.ops.all_reduce(x * 2, "sum", name) + 1, gathered

    traced = torch.fx.symbolic_trace(Step())
    targets = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert "loom.all_reduce" in targets and "loom.all_gather_into_tensor_out" in targets, targets
    reduced, gathered = traced(torch.full((4,), float(rank + 1)))
    torch.testing.assert_close(reduced, torch.full((4,), 2.0 * world * (world + 1) / 2 + 1))
    torch.testing.assert_close(gathered, torch.arange(1.0, world + 1).repeat_interleave(4))

    meta = torch.empty(4, device="meta")
    got = loom.ops.all_reduce(meta, "sum", name)
    assert got.is_meta and got.shape == (4,)
    loom.ops.all_reduce_(meta, "sum", name)
    loom.ops.broadcast_(meta, 0, name)
    assert loom.ops.all_gather_into_tensor(meta, world, name).shape == (world * 4,)
    # A model made on the meta device, as deferred initialisation does (without grad: the
    # operators refuse inputs that require it, on every device).
    with torch.device("meta"), torch.no_grad():
        layer = torch.nn.Linear(4, 4)
        out = loom.ops.all_reduce(layer(torch.empty(2, 4)), "sum", name)
    assert out.is_meta and out.shape == (2, 4)


def test_symbolic_trace_and_meta_tensors_reach_the_operators():
    run_ranks(2, symbolic_trace_and_meta_body)


def data_dependent_splits_body(rank: int, world: int) -> None:
    """all_to_all_single with split sizes read from a tensor inside torch.compile (unbacked
    SymInts, as a mixture-of-experts layer makes them): the schema takes SymInt[], as torch's
    functional all_to_all_single does, and the compiled call equals the eager one."""
    import loom.ops
    import torch._dynamo

    torch._dynamo.config.capture_scalar_outputs = True
    name = dist.group.WORLD.group_name
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    splits = torch.tensor([1, 3] if rank == 0 else [3, 1])

    def exchange(x, splits):
        sizes = splits.tolist()
        return loom.ops.all_to_all_single(x, sizes, sizes, name)

    eager = exchange(x, splits)
    compiled = torch.compile(exchange, fullgraph=True)(x, splits)
    torch.testing.assert_close(compiled, eager)
    want = torch.tensor([0.0, 10.0, 11.0, 12.0]) if rank == 0 else torch.tensor([1.0, 2.0, 3.0, 13.0])
    torch.testing.assert_close(eager, want)


def test_split_sizes_read_from_tensors_compile():
    run_ranks(2, data_dependent_splits_body)


def destroyed_meanwhile_body(rank: int, world: int, entry: str) -> str | None:
    """A thread's direct call is waiting (rank 1 never joins it) while the main thread
    destroys the group and drops it: the call still ends with the group's timeout error and
    the process goes on (it used to hang in the communicator's teardown, which the call's
    operation kept waiting)."""
    import gc
    import threading
    import time
    from datetime import timedelta

    group = dist.new_group(backend="loom", timeout=timedelta(seconds=2))
    name = group.group_name
    if rank == 1:
        return None
    outcome = []

    def call():
        try:
            entry_ops(entry).all_reduce_(torch.ones(4), "sum", name)
            outcome.append("returned")
        except RuntimeError as e:
            outcome.append(str(e))

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.5)  # the call is waiting by then (nothing checks it: a later call fails alike)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    thread.join()
    return outcome[0]


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_group_destroyed_during_a_call_waits_for_it(entry):
    outcome = run_ranks(2, destroyed_meanwhile_body, entry, timeout=60)[0]
    assert "all_reduce" in outcome and "rank 1" in outcome, outcome


def body_under_desync_debug(rank: int, world: int):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every backend in torch's ProcessGroupWrapper: the
    operators, the eager functions and progress_report reach loom inside it."""
    import loom
    import loom.ops

    name = dist.group.WORLD.group_name
    t = torch.full((3,), float(rank + 1))
    torch.ops.loom.all_reduce_(t, "sum", name)
    eager = loom.ops.all_reduce(torch.ones(2), "sum", name)
    report = loom.progress_report()
    return t.tolist(), eager.tolist(), "last started" in report


def test_the_entries_reach_loom_under_desync_debug():
    results = run_ranks(2, body_under_desync_debug, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert results == [([3.0, 3.0, 3.0], [2.0, 2.0], True)] * 2


def body_two_paths_under_desync_debug(rank: int, world: int):
    """One call, a contiguous tensor on rank 0 (the direct path) and a transposed one of the
    same shape on rank 1 (the c10d path): under LOOM_DESYNC_DEBUG both carry the call's
    shapes, so the ranks agree (the direct path carried none, a named mismatch)."""
    name = dist.group.WORLD.group_name
    x = torch.arange(16.0).reshape(4, 4)
    t = x.clone() if rank == 0 else x.t().contiguous().t()  # same values, rank 1 transposed
    torch.ops.loom.all_reduce_(t, "sum", name)
    out = torch.empty(8, 4)
    torch.ops.loom.all_gather_into_tensor_out(x if rank == 0 else x.t().contiguous().t(), world, name, out=out)
    return torch.equal(t, 2 * x), torch.equal(out, torch.cat([x, x]))


def test_a_call_on_the_direct_and_the_c10d_path_agrees_under_desync_debug():
    assert run_ranks(2, body_two_paths_under_desync_debug, env={"LOOM_DESYNC_DEBUG": "1"}) == [(True, True)] * 2


def body_tensor_subclasses(rank: int, world: int):
    """A tensor subclass with its own dispatch (a wrapper subclass here; DTensor is another)
    has no memory the kernel could read: loom.ops's eager functions hand it to the operator,
    whose __torch_dispatch__ decides, as torch.ops.loom.* does."""
    import loom.ops
    from torch.testing._internal.two_tensor import TwoTensor

    name = dist.group.WORLD.group_name
    pair = TwoTensor(torch.ones(2), torch.full((2,), 2.0))
    eager = loom.ops.all_reduce(pair, "sum", name)
    operator = torch.ops.loom.all_reduce(pair, "sum", name)
    inplace = TwoTensor(torch.ones(3), torch.full((3,), 3.0))
    loom.ops.all_reduce_(inplace, "sum", name)
    return [(type(t).__name__, t.a.tolist(), t.b.tolist()) for t in (eager, operator, inplace)]


def test_tensor_subclasses_go_through_the_operator():
    results = run_ranks(2, body_tensor_subclasses)
    assert results[0] == results[1] == [("TwoTensor", [2.0, 2.0], [4.0, 4.0])] * 2 + [
        ("TwoTensor", [2.0, 2.0, 2.0], [6.0, 6.0, 6.0])]
