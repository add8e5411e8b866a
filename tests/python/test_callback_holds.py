"""Completion callbacks that hold a group's queue: they run on loom's worker thread, ahead
of the calls queued after them, so one that waits for such a call, or runs past the timeout,
keeps those calls from starting. Each case below hung for good before loom watched for it
(or, for the slow callback, failed the peers with a timeout that said nothing of the
callback); now every rank fails within about the group's timeout with the reason, and the
other groups go on."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from harness import run_ranks

TIMEOUT_S = 3  # the held group's timeout: how long its queued calls may wait


def _first_call(group, rank: int):
    """An all_reduce whose callbacks are chained before it ends: on rank 0 surely (rank 1
    issues it half a second late), on rank 1 almost surely (it moves 16 MiB, which takes
    milliseconds where chaining takes microseconds). One that had ended would run its
    callback at once on the caller's thread, as torch's futures do: rank 1 then learns of
    rank 0's hold, at another time, which the checks below allow."""
    if rank == 1:
        time.sleep(0.5)
    return dist.all_reduce(torch.ones(1 << 22), group=group, async_op=True)


def _outcome(call) -> tuple[str, float]:
    """Runs `call`: ("ok" or its error's message, seconds taken)."""
    start = time.monotonic()
    try:
        call()
        return "ok", time.monotonic() - start
    except Exception as e:  # noqa: BLE001  (the message is what the test checks)
        return str(e), time.monotonic() - start


def _still_usable(rank: int) -> float:
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)  # the default group: not the one held
    return t[0].item()


def body_a_later_calls_future_taken_before_the_callback(rank: int, world: int):
    group = dist.new_group(backend="loom", timeout=timedelta(seconds=TIMEOUT_S))
    first = _first_call(group, rank)
    second = dist.all_reduce(torch.ones(4), group=group, async_op=True)
    later = second.get_future()  # taken now: waiting on it cannot run loom's queue
    chained = first.get_future().then(lambda fut: later.wait())
    message, took = _outcome(chained.wait)
    return message, took, _still_usable(rank)


def body_an_event_set_after_the_next_call(rank: int, world: int):
    group = dist.new_group(backend="loom", timeout=timedelta(seconds=TIMEOUT_S))
    event = threading.Event()
    first = _first_call(group, rank)
    chained = first.get_future().then(lambda fut: event.wait(3 * TIMEOUT_S))
    message, took = _outcome(lambda: dist.all_reduce(torch.ones(4), group=group))
    event.set()  # the callback returns, and the group's worker with it
    chained.wait()
    after, _ = _outcome(lambda: dist.all_reduce(torch.ones(4), group=group))
    return message, took, after, _still_usable(rank)


def body_two_groups_whose_callbacks_wait_on_each_other(rank: int, world: int):
    a = dist.new_group(backend="loom", timeout=timedelta(seconds=TIMEOUT_S))
    b = dist.new_group(backend="loom", timeout=timedelta(seconds=TIMEOUT_S))
    a_first = _first_call(a, rank)
    a_later = dist.all_reduce(torch.ones(4), group=a, async_op=True).get_future()
    b_first = dist.all_reduce(torch.ones(1 << 22), group=b, async_op=True)
    b_later = dist.all_reduce(torch.ones(4), group=b, async_op=True).get_future()
    # Each group's callback waits for the other's later call, queued behind its callback.
    a_chained = a_first.get_future().then(lambda fut: b_later.wait())
    b_chained = b_first.get_future().then(lambda fut: a_later.wait())
    return (_outcome(a_chained.wait)[0], _outcome(b_chained.wait)[0], _still_usable(rank))


def body_a_given_up_calls_callback_destroys_the_group(rank: int, world: int):
    """The given-up call's own callbacks run on the watch's thread: destroying the group
    there waited for itself, for good (a review's probe); now it is refused, as on loom's
    worker thread."""
    group = dist.new_group(backend="loom", timeout=timedelta(seconds=TIMEOUT_S))
    first = _first_call(group, rank)
    second = dist.all_reduce(torch.ones(4), group=group, async_op=True)
    later = second.get_future()
    ended = threading.Event()
    said = []

    def destroy_the_group(fut):
        try:
            dist.destroy_process_group(group)
            said.append("destroyed")
        except Exception as e:  # noqa: BLE001  (the message is what the test checks)
            said.append(str(e))
        ended.set()

    later.then(destroy_the_group)
    first.get_future().then(lambda fut: later.wait())
    if not ended.wait(TIMEOUT_S + 20):
        return "the callback did not end"
    return said[0]


def body_a_callback_slower_than_the_timeout(rank: int, world: int):
    group = dist.new_group(backend="loom", timeout=timedelta(seconds=TIMEOUT_S))
    first = _first_call(group, rank)
    chained = first.get_future().then(
        lambda fut: time.sleep(TIMEOUT_S + 2) if rank == 0 else None)  # rank 0's surely chained
    message, took = _outcome(lambda: dist.all_reduce(torch.ones(4), group=group))
    chained.wait()
    return message, took, _still_usable(rank)


def _named(message: str, rank: int) -> bool:
    """The error names the rank and says what held the group (and, on rank 0, whose queue is
    held, what to do). Rank 1 may learn of it from rank 0's failure, or from its own timeout
    waiting for rank 0, which then says that rank 0 runs its completion callbacks."""
    if rank == 1:
        return "completion callback" in message and "rank 1" in message
    return ("completion callback" in message and "make a new communicator" in message
            and "rank 0" in message)


def test_a_callback_waiting_on_a_later_calls_future_fails_the_group_by_name():
    for rank, (message, took, usable) in enumerate(
            run_ranks(2, body_a_later_calls_future_taken_before_the_callback, timeout=60)):
        if rank == 0:
            assert "all_reduce #2 never started" in message, message
            assert "behind a completion callback of its call #1" in message, message
            assert TIMEOUT_S - 0.5 < took < TIMEOUT_S + 10, took
        assert _named(message, rank), message
        assert took < TIMEOUT_S + 10, took
        assert usable == 3.0


def test_a_callback_waiting_for_what_the_next_call_brings_fails_that_call_by_name():
    for rank, (message, took, after, usable) in enumerate(
            run_ranks(2, body_an_event_set_after_the_next_call, timeout=60)):
        if rank == 0:
            assert "all_reduce #2 never started" in message, message
            assert TIMEOUT_S - 0.5 < took < TIMEOUT_S + 10, took
        assert _named(message, rank), message
        assert took < TIMEOUT_S + 10, took
        assert after != "ok", after  # the held group stays failed
        assert usable == 3.0


def test_two_groups_whose_callbacks_wait_on_each_other_end_by_name():
    for rank, (a, b, usable) in enumerate(
            run_ranks(2, body_two_groups_whose_callbacks_wait_on_each_other, timeout=60)):
        # The first hold found breaks the cycle: its group's later call is given up, which
        # ends the other group's callback, and that group may then go on.
        for message in (a, b):
            assert message == "ok" or _named(message, rank), message
        assert rank == 1 or any("never started" in m for m in (a, b)), (a, b)
        assert usable == 3.0


def test_a_given_up_calls_callback_that_destroys_the_group_is_refused_not_stuck():
    said = run_ranks(2, body_a_given_up_calls_callback_destroys_the_group, timeout=60)
    # Rank 0's call was given up by its own watch; rank 1's may have ended with the failure.
    assert "completion callback" in said[0] and "shut" in said[0], said[0]
    assert said[1] != "the callback did not end", said[1]


def test_a_callback_slower_than_the_timeout_is_what_every_rank_is_told():
    results = run_ranks(2, body_a_callback_slower_than_the_timeout, timeout=60)
    for message, took, usable in results:
        # The peer's own timeout may come first: it then says where rank 0 is.
        assert "completion callback" in message, message
        assert took < TIMEOUT_S + 10, took
        assert usable == 3.0
    # Rank 0's own call was held: it says so whichever rank's failure came first.
    assert "all_reduce #2 never started" in results[0][0], results[0][0]
