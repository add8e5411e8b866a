"""Work.get_duration() on loom's works (torch's `Work._get_duration()`), after the group's
`_enable_collectives_timing()`, as NCCL answers it under TORCH_NCCL_ENABLE_TIMING: the
call's active time, from when it began to run to when it ended. Gloo, whose
enable_collectives_timing() does nothing, answers no work's duration; loom raised on both
calls before it timed its calls. The bounds asserted come from waits the tests make on
purpose (a peer that joins late), never from how fast anything runs."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

LATE = 0.5  # seconds rank 1 waits before joining a call
AT_LEAST = 0.25  # what rank 0's call must then have lasted, whatever the skew of a barrier


def refusal(work) -> str:
    """The first line of what work._get_duration() raises, or "answered"."""
    try:
        work._get_duration()
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return "answered"


def body_untimed(rank: int, world: int):
    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.wait()
    return refusal(work)


def test_an_untimed_groups_works_say_how_to_time_them():
    for message in run_ranks(2, body_untimed):
        assert "_enable_collectives_timing()" in message and "all_reduce" in message, message


def body_late_peer(rank: int, world: int):
    group = dist.group.WORLD
    group._enable_collectives_timing()
    dist.barrier()
    if rank == 1:
        time.sleep(LATE)
    waited = dist.all_reduce(torch.ones(1 << 12), async_op=True)
    # Queued behind the first: it waits there, but starts to run only when that one ends.
    queued = dist.all_reduce(torch.ones(4), async_op=True)
    early = refusal(waited) if rank == 0 else None
    waited.wait()
    queued.wait()
    return early, waited._get_duration(), queued._get_duration()


def test_a_call_lasts_until_its_late_peer_joins_and_the_next_from_its_start():
    (early, waited, queued), (_, peer_waited, peer_queued) = run_ranks(2, body_late_peer)
    assert "has not ended yet" in early, early
    assert waited >= AT_LEAST * 1000, (waited, queued)
    # The second call spent the late peer's wait in the queue, which is not its time.
    assert queued < waited, (waited, queued)
    assert peer_waited >= 0 and peer_queued >= 0


def body_send_recv(rank: int, world: int):
    dist.group.WORLD._enable_collectives_timing()
    dist.barrier()
    if rank == 0:
        work = dist.irecv(torch.empty(16), src=1)
    else:
        time.sleep(LATE)
        work = dist.isend(torch.ones(16), dst=0)
    work.wait()
    return work._get_duration()


def test_a_receive_lasts_until_its_message_comes():
    received, _ = run_ranks(2, body_send_recv)
    assert received >= AT_LEAST * 1000, received


def body_coalesced(rank: int, world: int):
    dist.group.WORLD._enable_collectives_timing()
    dist.barrier()
    if rank == 1:
        time.sleep(LATE)
    with dist._coalescing_manager(async_ops=True) as manager:
        dist.all_reduce(torch.ones(8))
        dist.all_reduce(torch.ones(8))
    manager.wait()
    return [work._get_duration() for work in manager.works]


def test_a_coalescing_blocks_work_is_timed():
    durations, _ = run_ranks(2, body_coalesced)
    assert durations and all(d >= AT_LEAST * 1000 for d in durations), durations


def blocking_all_reduce(tensor):
    """A blocking call's own work (dist.all_reduce without async_op waits for it and drops
    it): it ran on the caller's thread, so it is over when it returns."""
    options = dist.AllreduceOptions()
    options.asyncOp = False
    return dist.group.WORLD.allreduce([tensor], options)


def body_blocking(rank: int, world: int):
    untimed = blocking_all_reduce(torch.ones(4))
    dist.group.WORLD._enable_collectives_timing()
    dist.barrier()
    if rank == 1:
        time.sleep(LATE)
    timed = blocking_all_reduce(torch.ones(4))
    return refusal(untimed), timed._get_duration()


def test_a_call_over_when_it_returns_is_timed_from_then_on():
    (untimed, timed), _ = run_ranks(2, body_blocking)
    assert "_enable_collectives_timing()" in untimed and "all_reduce" in untimed, untimed
    assert timed >= AT_LEAST * 1000, timed


def body_other_group(rank: int, world: int):
    other = dist.new_group(backend="loom")
    dist.group.WORLD._enable_collectives_timing()
    work = dist.all_reduce(torch.ones(4), group=other, async_op=True)
    work.wait()
    return refusal(work)


def test_timing_is_per_group():
    for message in run_ranks(2, body_other_group):
        assert "_enable_collectives_timing()" in message, message


@pytest.mark.parametrize("backend", ["gloo"])
def test_gloo_answers_no_duration(backend):
    # What loom's answers stand beside: Gloo accepts the switch and times nothing.
    def body(rank, world):
        dist.group.WORLD._enable_collectives_timing()
        work = dist.all_reduce(torch.ones(4), async_op=True)
        work.wait()
        return refusal(work)

    for message in run_ranks(2, body, backend=backend):
        assert message != "answered", message
