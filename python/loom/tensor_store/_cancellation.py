"""Cancellation of an AsyncTensorStore verb. The verb runs on a thread of its own; a cancel
tells that thread, which stops at its next wait, and waits only for the verb's section that
reads or writes the caller's tensors (its copies), if one runs: after that the verb never
touches them again, whatever it still waits for before it notices. A fetch from another
host is told at once (its StopFlag), so a vanished host does not keep its buffer's fetch lock
until the deadline."""

from __future__ import annotations

import contextlib
import threading

from .. import _C


class Cancelled(Exception):
    """The coroutine awaiting this verb was cancelled; nobody reads this verb's outcome."""


class Token:
    """One verb's cancellation: `event` says it was cancelled; `section` is held while the
    verb touches the caller's tensors; `stop` stops its fetches from other hosts."""

    def __init__(self):
        self.event = threading.Event()
        self.section = threading.Lock()
        self.stop = _C.StopFlag()

    def cancel(self) -> None:
        """Cancels the verb, returning once it no longer touches the caller's tensors."""
        self.event.set()
        self.stop.set()
        with self.section:  # a section under way ends; none starts after (it checks the event)
            pass


_current = threading.local()


def run_cancellable(token: Token, verb, *args, **kwargs):
    """verb(*args, **kwargs) on this thread, stopping where it checks once `token` is cancelled."""
    _current.token = token
    try:
        return verb(*args, **kwargs)
    finally:
        _current.token = None


def current_stop_flag():
    """The StopFlag of the verb this thread runs for a coroutine, or None."""
    token = getattr(_current, "token", None)
    return None if token is None else token.stop


def stop_if_cancelled() -> None:
    """Raises Cancelled if the verb this thread runs for a coroutine was cancelled."""
    token = getattr(_current, "token", None)
    if token is not None and token.event.is_set():
        raise Cancelled()


@contextlib.contextmanager
def touching_callers_tensors():
    """Held while a verb reads or writes the caller's tensors: a cancel waits for it to end,
    and a verb cancelled before it enters stops there (Cancelled). (A collective verb cannot
    stop: its cancel waits for all of it, _COLLECTIVE_VERBS.)"""
    token = getattr(_current, "token", None)
    if token is None:
        yield
        return
    with token.section:
        stop_if_cancelled()
        yield
