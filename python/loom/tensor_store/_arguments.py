"""Checks of arguments that several of the tensor store's verbs take."""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def is_version_number(value: Any) -> bool:
    """Whether `value` may name a version: an int, and not a bool (True is an int to Python,
    and would be stored as the text "True", which no reader could parse)."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_timeout(value: Any, where: str) -> timedelta | None:
    """`value` as a timedelta: None stays None, a number counts seconds (as torch's own
    timeouts are often written); anything else is refused naming `where`."""
    if value is None or isinstance(value, timedelta):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return timedelta(seconds=value)
    raise TypeError(f"{where}: timeout must be a datetime.timedelta or a number of seconds, "
                    f"not {type(value).__name__}")
