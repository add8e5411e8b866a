"""Cancellation of an AsyncTensorStore verb: the thread that runs it is told, and the verb
stops at its next wait, or before its copies into the caller's tensors begin (copies begun
finish: stopped half way they would leave the tensors holding part of a version)."""

from __future__ import annotations

import threading


class Cancelled(Exception):
    """The coroutine awaiting this verb was cancelled; nobody reads this verb's outcome."""


_current = threading.local()


def run_cancellable(cancel: threading.Event, verb, *args, **kwargs):
    """verb(*args, **kwargs) on this thread, stopping where it checks once `cancel` is set."""
    _current.event = cancel
    try:
        return verb(*args, **kwargs)
    finally:
        _current.event = None


def stop_if_cancelled() -> None:
    """Raises Cancelled if the verb this thread runs for a coroutine was cancelled."""
    event = getattr(_current, "event", None)
    if event is not None and event.is_set():
        raise Cancelled()
