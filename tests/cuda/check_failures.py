"""The failure parts of check_cuda.py: calls that disagree (collectives, send/recv tags, a
rooted call's roots, a root against non-roots that name another), a rank killed
mid-collective or while the others replay a captured call, a rank that never issues a call, one
that destroys its group and lives on (also while the others replay a captured all_reduce or
receive from it), a sender whose kernels stopped (its peers must not take a chunk left in its
mailbox slot for a new one), one that cannot make its CUDA workspace and
one whose LOOM_CUDA_* settings differ, PREMUL_SUM factors that differ by rank. Each checks that
every rank gets an error naming the cause, never a wrong answer or a hang, and that the GPU is
usable afterwards. Also the refusals and deadlines that must not fail the group: a call's
timeout of centuries, and a coalescing block with a refused operation inside a capture. Run through
check_cuda.py (its worker dispatches here)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from check_common import same


def first_call_refused(rank: int, world: int, dev: torch.device, parts, what: str) -> None:
    """This rank's first CUDA call (an all_reduce) fails within 30 s with an error saying
    every one of `parts`; `what` says why it must not succeed."""
    start = time.time()
    try:
        dist.all_reduce(torch.ones(8, device=dev))
        torch.cuda.synchronize()
        raise AssertionError(f"the first CUDA call succeeded though {what}")
    except RuntimeError as e:
        for part in parts:
            assert part in str(e), f"the error lacks {part!r}: {e}"
    took = time.time() - start
    assert took < 30, f"the failure took {took:.1f} s to reach rank {rank} (timeout is 60 s)"

def mismatch(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """Rank 0 all_reduces 1000 elements, the others 2000: every rank gets an error naming
    both calls (never a wrong answer), and the GPU stays usable."""
    x = torch.ones(1000 if rank == 0 else 2000, device=dev)
    words = ["1000 elements", "2000 elements", "issued all_reduce"]
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()  # returns: the kernels that found it did nothing
    except RuntimeError as e:
        # A rank that issues the call after a peer has reported the mismatch is told at once.
        return expect_named(e, dev, words)
    return expect_failure(rank, dev, words)


def factor_mismatch(rank: int, world: int, dev: torch.device, on_device: bool) -> int:
    """Rank 0 all_reduces with PREMUL_SUM by 0.5, the others by 0.25 (as numbers, or as CUDA
    tensors that only the GPU reads): each rank would scale every rank's data by its own
    factor and get sums that differ by rank, so every rank gets an error naming both
    factors instead, and the GPU stays usable."""
    value = 0.5 if rank == 0 else 0.25
    factor = torch.tensor(value, device=dev) if on_device else value
    x = torch.ones(1000, device=dev)
    words = ["PREMUL_SUM by 0.5", "PREMUL_SUM by 0.25", "every rank must issue"]
    try:
        dist.all_reduce(x, op=dist._make_nccl_premul_sum(factor))
        torch.cuda.synchronize()
    except RuntimeError as e:
        return expect_named(e, dev, words)
    return expect_failure(rank, dev, words)


def tag_mismatch(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """Rank 0 sends with tag 1, rank 1 receives with tag 2: both learn of it by name."""
    if rank == 0:
        dist.send(torch.ones(10, device=dev), dst=1, tag=1)
    elif rank == 1:
        dist.recv(torch.empty(10, device=dev), src=0, tag=2)
    torch.cuda.synchronize()
    return expect_failure(rank, dev, ["tag 1", "tag 2", "in the order they are issued"])


def rooted_mismatch(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """Rank 0 scatters from itself while the others gather to rank 0: a scatter's root and a
    gather's non-roots only publish what they issue, so unless a non-root checks its root,
    nobody sees the mismatch. Every rank then queues an all_reduce like the one two steps
    before: the ranks that found the mismatch skip it (their kernels stop) without
    publishing, and rank 0 must not take their descriptors left from that earlier call for
    theirs and succeed on stale slots. Every rank gets the named error, and the GPU stays
    usable."""
    earlier = torch.full((1000,), 5.0, device=dev)
    dist.all_reduce(earlier)
    x = torch.ones(1000, device=dev)
    y = torch.ones(1000, device=dev)
    words = ["scatter of float32, 1000 elements", "gather of float32, 1000 elements",
             "every rank must issue the same collectives"]
    try:
        if rank == 0:
            first = dist.scatter(x, [torch.full((1000,), float(q), device=dev)
                                     for q in range(world)], src=0, async_op=True)
        else:
            first = dist.gather(x, None, dst=0, async_op=True)
        second = dist.all_reduce(y, async_op=True)  # queued before any rank knows
        # A CUDA work's wait() only orders the stream; with a timeout the host waits for
        # the outcome too, and raises a failure.
        for work in (first, second):
            work.wait(timeout=timedelta(seconds=30))
    except RuntimeError as e:
        return expect_named(e, dev, words)
    raise AssertionError(f"rank {rank}'s calls succeeded after a mismatch; the all_reduce gave "
                         f"{y[0].item()} (every rank's 1.0 would make {world})")


def self_rooted(rank: int, world: int, dev: torch.device, op: str) -> int:
    """The last rank broadcasts (or scatters) from itself while the others name rank 0 (at
    P = 2: each rank names itself): a root only publishes, so unless a root checks its
    non-roots, ranks 0 and P - 1 each keep their own data and succeed. Every rank gets the
    named error for that call and for an all_reduce queued behind it, and the GPU stays
    usable."""
    root = world - 1 if rank == world - 1 else 0
    n = int(os.environ.get("LOOM_CHECK_ROOTED_ELEMENTS", "1000"))
    x = torch.full((n,), float(rank), device=dev)
    y = torch.ones(1000, device=dev)
    words = [f"{op} of float32, {n} elements, root 0", f"{op} of float32, {n} elements, "
             f"root {world - 1}", "every rank must issue the same collectives"]
    try:
        if op == "broadcast":
            first = dist.broadcast(x, src=root, async_op=True)
        else:
            pieces = [torch.full((n,), float(q), device=dev) for q in range(world)]
            first = dist.scatter(x, pieces if rank == root else None, src=root, async_op=True)
        second = dist.all_reduce(y, async_op=True)
        for work in (first, second):
            work.wait(timeout=timedelta(seconds=30))
    except RuntimeError as e:
        return expect_named(e, dev, words)
    raise AssertionError(f"rank {rank}'s {op} from rank {root} succeeded though rank "
                         f"{0 if root else world - 1} named another root")


def settings_differ(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """The last rank runs with another LOOM_CUDA_CHUNK_BYTES (PART_ENV), so its workspace has
    another layout: every rank's first CUDA call fails at once naming the setting, the rank
    and both values, instead of any rank reading or writing a peer's slots at the wrong
    offsets, and the GPU stays usable."""
    first_call_refused(rank, world, dev,
                       (f"rank {world - 1}'s LOOM_CUDA_CHUNK_BYTES is ", " but rank 0's is ",
                        "set them alike on every rank"), "the ranks' settings differ")
    assert torch.ones(4, device=dev).sum().item() == 4.0
    return 1


def late_rank(rank: int, world: int, dev: torch.device, op: str = "all_reduce") -> int:
    """The last rank takes part in a group's first call, then issues nothing: the others'
    next call (`op`: an all_reduce, or a broadcast or scatter from that rank, whose
    non-roots raise their flags before they wait for the root) fails at the group's 5 s
    timeout naming that rank as the one that has not reached it (read from its flags), and
    the GPU stays usable."""
    group = dist.new_group(timeout=timedelta(seconds=5))
    x = torch.ones(1000, device=dev)
    dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    if rank == world - 1:
        time.sleep(15)  # alive past the others' timeout: theirs is a timeout, not a death
        return 1
    try:
        late = world - 1
        if op == "broadcast":
            work = dist.broadcast(x, src=late, group=group, async_op=True)
        elif op == "scatter":
            work = dist.scatter(x, None, src=late, group=group, async_op=True)
        else:
            work = dist.all_reduce(x, group=group, async_op=True)
        work.wait(timeout=timedelta(seconds=30))
        raise AssertionError(f"the {op} succeeded though a rank never issued it")
    except RuntimeError as e:
        for part in ("did not finish within its timeout", f"rank {late} (its last step",
                     "have not issued it"):
            assert part in str(e), f"the error lacks {part!r}: {e}"
        for q in range(world - 1):
            assert f"rank {q} (its last step" not in str(e), f"rank {q} is named late: {e}"
    assert torch.ones(4, device=dev).sum().item() == 4.0
    return 1


def expect_failure(rank: int, dev: torch.device, words) -> int:
    deadline = time.time() + 30
    while True:
        try:
            dist.all_reduce(torch.ones(4, device=dev))
            torch.cuda.synchronize()
        except RuntimeError as e:
            return expect_named(e, dev, words)
        assert time.time() < deadline, "no rank reported the mismatch within 30 s"
        time.sleep(0.5)


def expect_named(e: RuntimeError, dev: torch.device, words) -> int:
    """The error says every one of `words`, and the GPU is still usable."""
    for w in words:
        assert w in str(e), f"the error does not say {w!r}: {e}"
    assert torch.ones(4, device=dev).sum().item() == 4.0
    return 1


def dead_rank_is_named(world: int, dev: torch.device, x: torch.Tensor) -> None:
    """After the last rank died: the next all_reduce fails naming it, and the GPU still works."""
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()
        raise AssertionError("an all_reduce after a rank died succeeded")
    except RuntimeError as e:
        assert f"rank {world - 1}" in str(e), f"the error does not name the dead rank: {e}"
    assert torch.ones(4, device=dev).sum().item() == 4.0


def killed_rank(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """The last rank exits; the others' CUDA all_reduce must not hang the GPU, the next call
    must name the dead rank, and the GPU must still work."""
    x = torch.ones(1 << 16, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == world - 1:
        os._exit(0)
    try:
        dist.all_reduce(x)  # waits on the GPU for a rank that is gone...
    except RuntimeError as e:  # ...unless its death is known already
        assert f"rank {world - 1}" in str(e), f"the error does not name the dead rank: {e}"
    time.sleep(2)
    torch.cuda.synchronize()  # must return: the waits are released once the rank is found dead
    dead_rank_is_named(world, dev, x)
    return 1


def left_rank(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """The last rank takes part in a call, then destroys its group (a clean leave) and lives
    on: the others' next CUDA call fails long before the group's 120 s timeout, naming it as
    having destroyed its communicator (it waited out the timeout before), and the GPU stays
    usable."""
    group = dist.new_group(timeout=timedelta(seconds=120))
    x = torch.ones(1000, device=dev)
    dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    if rank == world - 1:
        dist.destroy_process_group(group)
        time.sleep(15)  # alive: a departure, not a death
        return 1
    start = time.time()
    try:
        dist.all_reduce(x, group=group, async_op=True).wait(timeout=timedelta(seconds=90))
        raise AssertionError("an all_reduce succeeded though a rank had destroyed its group")
    except RuntimeError as e:
        for part in (f"rank {world - 1} had already destroyed its communicator", "fewer collectives"):
            assert part in str(e), f"the error lacks {part!r}: {e}"
    assert time.time() - start < 60, "the call waited for its timeout instead of naming the rank that left"
    assert torch.ones(4, device=dev).sum().item() == 4.0
    return 1


def left_p2p(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """The last rank destroys its groups (a clean leave) and lives on while rank 0 waits on a
    receive from it that it never sends: the receive fails long before the group's 120 s
    timeout, naming it as having destroyed its communicator, and a send to it in another group
    is refused at once; the GPU stays usable. (The receive waited out the timeout before, and
    a small send "succeeded" into the mailbox of a rank that had left.) From P = 3, ranks 0
    and 1 go on: in a batch that also sends to the departed rank only that send is refused,
    and a send to it that had finished before it left fails none of their later transfers.
    (On a GPU a send ends only once received, as NCCL's: the part first had the departing
    rank never receive it, and rank 0's GPU waited for its receiver, call 21; and rank 0
    synchronized the whole device, which holds its pending receive, call 22.)"""
    group = dist.new_group(timeout=timedelta(seconds=120))
    other = dist.new_group(timeout=timedelta(seconds=120))
    third = dist.new_group(timeout=timedelta(seconds=120))
    last = world - 1
    x = torch.ones(1000, device=dev)
    for g in (group, other, third):
        dist.all_reduce(x, group=g)
    torch.cuda.synchronize()
    work = dist.irecv(x, src=last, group=group) if rank == 0 else None  # never sent
    if rank == 0 and world >= 3:  # a send that ended before its receiver left
        dist.isend(torch.ones(4, device=dev), dst=last, group=third).wait()
        # Not torch.cuda.synchronize(): the device's work includes the receive above, which
        # waits on the GPU until the departure fails it.
        torch.cuda.current_stream().synchronize()
    if rank == last and world >= 3:  # on a GPU a send ends only once received, as NCCL's
        dist.recv(torch.empty(4, device=dev), src=0, group=third)
        torch.cuda.synchronize()
    dist.barrier()
    if rank == last:
        for g in (group, other, third):
            dist.destroy_process_group(g)
    dist.barrier()
    if rank == 1 and world >= 3:
        got = torch.zeros(4, device=dev)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, 0, other),
                                         dist.P2POp(dist.isend, torch.full((4,), 1.0, device=dev), 0, other)]):
            w.wait()
        dist.recv(got[:2], src=0, group=third)
        dist.send(torch.full((2,), 3.0, device=dev), dst=0, group=third)
        torch.cuda.synchronize()
        assert got.tolist() == [5.0, 5.0, 2.0, 2.0], got.tolist()  # the batch's, then third's
    if rank != 0:
        time.sleep(15)  # alive: a departure, not a death (and no rank's exit fails the others)
        return 1
    start = time.time()
    try:
        work.wait(timeout=timedelta(seconds=90))
        raise AssertionError("a receive from a rank that had destroyed its group succeeded")
    except RuntimeError as e:
        for part in (f"rank {last} had already destroyed its communicator", "never sends"):
            assert part in str(e), f"the error lacks {part!r}: {e}"
    assert time.time() - start < 60, "the receive waited for its timeout instead of naming the rank that left"
    start = time.time()
    try:
        dist.send(torch.ones(4, device=dev), dst=last, group=other)
        torch.cuda.synchronize()
        raise AssertionError("a send to a rank that had destroyed its group succeeded")
    except RuntimeError as e:
        assert "the receiver destroyed its communicator" in str(e), str(e)
    assert time.time() - start < 10, "the send was not refused at once"
    checks = 2
    if world >= 3:
        theirs = torch.zeros(4, device=dev)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(4, device=dev), last, other),
                                        dist.P2POp(dist.isend, torch.full((4,), 2.0, device=dev), 1, other),
                                        dist.P2POp(dist.irecv, theirs, 1, other)])
        try:
            works[0].wait()
            raise AssertionError("a batched send to a rank that had destroyed its group succeeded")
        except RuntimeError as e:
            assert "the receiver destroyed its communicator" in str(e), str(e)
        for w in works[1:]:
            w.wait()
        torch.cuda.synchronize()
        assert theirs.tolist() == [1.0] * 4, theirs.tolist()
        dist.send(torch.full((2,), 5.0, device=dev), dst=1, group=third)
        back = torch.zeros(2, device=dev)
        dist.recv(back, src=1, group=third)
        torch.cuda.synchronize()
        assert back.tolist() == [3.0, 3.0], back.tolist()
        checks += 2
    assert torch.ones(4, device=dev).sum().item() == 4.0
    return checks


def replayed_all_reduce(world: int, dev: torch.device):
    """An all_reduce of 2^16 ones captured in a CUDA graph and replayed once with every rank
    (checked), then a barrier: the tensor and the graph."""
    x = torch.ones(1 << 16, device=dev)
    dist.all_reduce(torch.ones(8, device=dev))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    same(x, torch.full((1 << 16,), float(world)), "a replay with every rank")
    dist.barrier()
    return x, graph


def graph_killed(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """The last rank exits while the others replay a captured all_reduce: their GPUs are
    released (the replay's waits end), and the next call names the dead rank."""
    x, graph = replayed_all_reduce(world, dev)
    if rank == world - 1:
        os._exit(0)
    graph.replay()  # waits on the GPU for a rank that is gone
    torch.cuda.synchronize()  # must return once the rank is found dead
    dead_rank_is_named(world, dev, x)
    return 2


def graph_left(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """The last rank destroys its group (a clean leave) and lives on while the others replay
    a captured all_reduce: their replays' waits end (they waited forever before), and the
    next call names the rank that left."""
    x, graph = replayed_all_reduce(world, dev)
    if rank == world - 1:
        dist.destroy_process_group()
        time.sleep(15)  # alive: a departure, not a death
        return 1
    graph.replay()  # waits on the GPU for a rank that left
    torch.cuda.synchronize()  # must return once the rank is found to have left
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()
        raise AssertionError("an all_reduce after a rank left succeeded")
    except RuntimeError as e:
        assert f"rank {world - 1} had already destroyed its communicator" in str(e), e
    assert torch.ones(4, device=dev).sum().item() == 4.0
    return 2


def graph_left_p2p(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """Rank 0 captures a receive from the last rank, which captures the matching send; after a
    replay together the last rank destroys its group and lives on while rank 0 replays again:
    that replay waits on the GPU for a send that never comes, and a replay has no deadline
    (it waited forever before). It must end, and the next call names the rank that left. The
    ranks between them capture nothing."""
    last = world - 1
    x = torch.zeros(1 << 12, device=dev)
    payload = torch.full((1 << 12,), 7.0, device=dev)
    dist.all_reduce(torch.ones(8, device=dev))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    if rank in (0, last):
        with torch.cuda.graph(graph):
            if rank == 0:
                dist.recv(x, src=last)
            else:
                dist.send(payload, dst=0)
        graph.replay()
        torch.cuda.synchronize()
    if rank == 0:
        same(x, torch.full((1 << 12,), 7.0), "a replayed receive with its sender there")
    dist.barrier()
    if rank == last:
        dist.destroy_process_group()
        time.sleep(15)  # alive: a departure, not a death
        return 1
    if rank != 0:
        time.sleep(15)  # alive: the ranks between must not exit (a death) before rank 0 is done
        return 1
    start = time.time()
    graph.replay()  # waits on the GPU for a send from a rank that left
    torch.cuda.synchronize()  # must return once the rank is found to have left
    assert time.time() - start < 60, "the replay waited a minute for the rank that left"
    try:
        dist.all_reduce(x)
        torch.cuda.synchronize()
        raise AssertionError("an all_reduce after a replay waited on a rank that left succeeded")
    except RuntimeError as e:
        for part in (f"rank {last} had already destroyed its communicator",
                     "a replay of a captured call waits for it in vain (a receive from it)"):
            assert part in str(e), f"the error lacks {part!r}: {e}"
    assert torch.ones(4, device=dev).sum().item() == 4.0
    return 2


def stale_chunk(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """Rank 0 sends rank 1 two messages, then a receive from the last rank finds it sent
    another size (a mismatch: rank 0's kernels stop), then rank 0 sends rank 1 a third message
    like its first. Its third send's flag still goes up (a stream's flag write cannot look at
    the abort word) over the mailbox slot the first went through, holding the first's chunk
    and a descriptor alike but for its chunk number: rank 1 must never take the first message
    for the third (it could before chunk numbers were in the descriptors). Every rank then gets
    the mismatch by name. Needs 3 ranks. It tries the stepped path, where transfers' flags are
    raised by stream writes; a fused transfer's stopped kernel raises no flags. Ranks
    time-sliced on one GPU do not open the window (rank 0's failure reaches rank 1 before its
    kernel runs: it passed on the tree before the mend too); ranks side by side do (MPS, or a
    GPU per rank with LOOM_CUDA_FUSED=0)."""
    last = world - 1
    if world < 3:
        return 0
    words = ["of 128 bytes", "of 256 bytes", "in the order they are issued"]
    got = [torch.full((64,), -1.0, device=dev) for _ in range(3)]
    try:  # a call issued once the mismatch is known fails at once
        if rank == 0:
            dist.send(torch.full((64,), 1.0, device=dev), dst=1)
            dist.send(torch.full((64,), 2.0, device=dev), dst=1)
            dist.recv(torch.empty(32, device=dev), src=last)
            dist.send(torch.full((64,), 3.0, device=dev), dst=1)
        elif rank == 1:
            for g in got:
                dist.recv(g, src=0)
        elif rank == last:
            dist.send(torch.ones(64, device=dev), dst=0)
        torch.cuda.synchronize()
    except RuntimeError as e:
        return expect_named(e, dev, words)
    if rank == 1:
        third = got[2].cpu()
        assert not torch.equal(third, torch.full((64,), 1.0)), \
            "rank 1 took rank 0's first message, left in its slot, for the third"
        assert torch.equal(third, torch.full((64,), -1.0)) or \
            torch.equal(third, torch.full((64,), 3.0)), f"the third message read {third[:4]}"
    return 1 + expect_failure(rank, dev, words)


def destroyed_meanwhile(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """A thread issues CUDA all_reduces on a group while the main thread destroys it, 20
    groups in a row: each call is queued before the shutdown (it runs, or fails naming a
    rank that left before it) or is refused; nothing crashes (the executor went while a
    call was on its way into it), nothing waits out the group's timeout, and the GPU stays
    usable."""
    import threading

    # Refused by loom (shut down), failed by loom (a peer left before a call it queued), or
    # refused by torch once the group is gone from its map.
    allowed = ("has been shut down", "had already destroyed its communicator", "Invalid process group",
               "not initialized in the world group map")
    checks = 0
    for round_ in range(20):
        group = dist.new_group(timeout=timedelta(seconds=60))
        x = torch.ones(1024, device=dev)
        dist.all_reduce(x, group=group)  # the group's CUDA path is set up
        torch.cuda.synchronize()
        issuing = threading.Event()
        outcome = []

        def calls():
            torch.cuda.set_device(dev)
            try:
                for i in range(8):
                    work = dist.all_reduce(x, group=group, async_op=True)
                    if i == 0:
                        issuing.set()  # calls are on their way: the destroy meets them
                    work.wait(timeout=timedelta(seconds=50))
                outcome.append("ran")
            except Exception as e:  # noqa: BLE001 - classified below
                outcome.append(str(e))
            issuing.set()

        thread = threading.Thread(target=calls)
        thread.start()
        issuing.wait(timeout=30)
        time.sleep(0.0002 * ((rank + round_) % 4))  # each round meets the calls at another point
        start = time.time()
        dist.destroy_process_group(group)
        thread.join(timeout=90)
        assert not thread.is_alive(), f"round {round_}: the calls still wait 90 s after the group was destroyed"
        assert time.time() - start < 45, f"round {round_}: destroying the group waited out its timeout"
        what = outcome[0]
        assert what == "ran" or any(a in what for a in allowed), f"round {round_}: {what}"
        checks += 1
    assert torch.ones(4, device=dev).sum().item() == 4.0
    return checks


def setup_refused(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """The last rank cannot make its CUDA workspace (it asks for 1 GiB chunks, more than
    12 GiB, with all but 4 GiB of the GPU taken): every rank's first CUDA call fails at once naming
    it, instead of waiting for its offer until the timeout, and the GPU stays usable."""
    hog = None
    if rank == world - 1:
        free, _ = torch.cuda.mem_get_info()
        hog = torch.empty(max(0, free - (4 << 30)), dtype=torch.uint8, device=dev)
    first_call_refused(rank, world, dev, (f"rank {world - 1}",), "a rank had no workspace")
    # The communicator keeps the failure: a later CUDA call (another operation) fails at once
    # with it, naming that call, instead of trying the set-up again and waiting on peers.
    start = time.time()
    try:
        dist.broadcast(torch.ones(8, device=dev), src=0)
        raise AssertionError("a later CUDA call succeeded though the set-up had failed")
    except RuntimeError as e:
        for part in ("broadcast", "failed earlier", f"rank {world - 1}"):
            assert part in str(e), f"the later call's error lacks {part!r}: {e}"
    assert time.time() - start < 5, "the later call waited instead of failing at once"
    del hog
    assert torch.ones(4, device=dev).sum().item() == 4.0
    return 1


def wrong_device(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """A group bound to its GPU (device_id) refuses an asynchronous call on another GPU by
    name, and its next asynchronous calls on its own GPU run: the refused call used to fix
    the group's stream on the wrong GPU, and every later one was refused. Needs a second GPU
    (on a one-GPU host: no checks)."""
    other = next((i for i in range(torch.cuda.device_count()) if i != dev.index), None)
    if other is None:
        return 0
    wrong = torch.ones(8, device=torch.device("cuda", other))
    try:
        dist.all_reduce(wrong, async_op=True).wait()
        raise AssertionError("an all_reduce on another GPU than the group's was accepted")
    except RuntimeError as e:
        assert f"bound to {dev}" in str(e), e
    right = torch.ones(8, device=dev)
    dist.all_reduce(right, async_op=True).wait()
    torch.cuda.synchronize()
    assert right.tolist() == [float(world)] * 8, right
    return 2


def long_timeout(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """A call's timeout of centuries means none, as on CPU: a CUDA call still queued behind the
    caller's kernel when loom first looks at it is not past a deadline that wrapped around.
    (Through the backend, whose options carry a timeout per call: torch's _set_pg_timeout
    changes only Gloo and NCCL groups.)"""
    backend = dist.distributed_c10d._get_default_group()._get_backend(dev)
    options = dist.AllreduceOptions()
    options.timeout = timedelta(days=120_000)
    x = torch.ones(1000, device=dev)
    torch.cuda._sleep(50_000_000)
    backend.allreduce([x], options).wait()
    torch.cuda.synchronize()
    same(x, torch.full((1000,), float(world)), "all_reduce with a timeout of centuries")
    dist.barrier()
    return 1


def refused_in_block(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """A coalescing block one of whose operations loom refuses (a receive from a rank outside
    the group, which torch passes on to the backend unchecked), after a send and a receive
    that loom queued on its stream, captured in a CUDA graph: the caller gets loom's error, and
    the capture still ends (the caller's stream joins the loom stream, where the block's other
    operations were queued) instead of failing as unjoined. Then the same eagerly: the values
    the block's other operations exchanged arrive."""
    pg = dist.distributed_c10d._get_default_group()
    peer = rank ^ 1
    checks = 0
    if peer < world:
        for captured in (True, False):
            out = torch.empty(64, device=dev)
            graph = torch.cuda.CUDAGraph()

            def block():
                pg._start_coalescing(dev)
                pg.send([torch.full((64,), float(rank), device=dev)], peer, 0)
                pg.recv([out], peer, 0)
                pg.recv([torch.empty(4, device=dev)], world + 5, 0)
                pg._end_coalescing(dev)

            try:
                if captured:
                    with torch.cuda.graph(graph):
                        block()
                else:
                    block()
                raise AssertionError("a receive from a rank outside the group was not refused")
            except RuntimeError as e:
                assert f"argument 'src' is {world + 5}" in str(e), f"not loom's refusal: {e}"
            if not captured:
                torch.cuda.synchronize()
                same(out, torch.full((64,), float(peer)), "the block's exchange beside the refusal")
            checks += 1
    dist.barrier()
    return checks


# Environment a part's ranks start with (by rank and world size), read when the group is made.
PART_ENV = {
    "setup_refused": lambda rank, world: {"LOOM_CUDA_CHUNK_BYTES": "1G"} if rank == world - 1 else {},
    # Another chunk than the one the run gives every rank (65536 where that is 64 KiB already).
    "settings_differ": lambda rank, world: (
        {"LOOM_CUDA_CHUNK_BYTES": "131072" if os.environ.get("LOOM_CUDA_CHUNK_BYTES") == "65536"
         else "65536"} if rank == world - 1 else {}),
}
