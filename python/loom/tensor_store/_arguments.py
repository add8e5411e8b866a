"""Checks of arguments that several of the tensor store's verbs take."""

from __future__ import annotations

from datetime import timedelta
from typing import Any


def is_version_number(value: Any) -> bool:
    """Whether `value` may name a version: an int, and not a bool (True is an int to Python,
    and would be stored as the text "True", which no reader could parse)."""
    return isinstance(value, int) and not isinstance(value, bool)


# The longest timeout taken (about 31 years): the waits below pass theirs to C++ and to the
# Store in whole milliseconds, where a larger one overflows.
_LONGEST_TIMEOUT_S = 1e9


def as_timeout(value: Any, where: str) -> timedelta | None:
    """`value` as a timedelta: None stays None, a number counts seconds (as torch's own
    timeouts are often written); anything else, or a span that is negative, not finite or
    longer than about 31 years, is refused naming `where`."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, timedelta):
        seconds = value.total_seconds()
    else:
        raise TypeError(f"{where}: timeout must be a datetime.timedelta or a number of seconds, "
                        f"not {type(value).__name__}")
    if not 0 <= seconds <= _LONGEST_TIMEOUT_S:  # NaN fails this too
        raise ValueError(f"{where}: timeout must be from 0 to {_LONGEST_TIMEOUT_S:.0e} seconds "
                         f"(about 31 years), not {value!r}; pass a long one to wait as long as it takes")
    return value if isinstance(value, timedelta) else timedelta(seconds=seconds)
