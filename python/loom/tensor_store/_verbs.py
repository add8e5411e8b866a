"""Which of the tensor store's verbs a thread runs, for its messages: verbs share their code
(get and get_state_dict the read, put and put_state_dict the write, lend and
lend_state_dict the lending), and each message names the one the caller called."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

_CALLED = contextvars.ContextVar("loom_tensor_store_verb", default="get")
_ANY = object()


@contextlib.contextmanager
def calling_as(verb: str):
    """Names the verb run inside the block `verb` in its messages."""
    token = _CALLED.set(verb)
    try:
        yield
    finally:
        _CALLED.reset(token)


def called_verb() -> str:
    """The verb this thread runs ("get" outside any calling_as)."""
    return _CALLED.get()


def asked(key: str, version: Any = _ANY) -> str:
    """The call in progress as its messages name it: get('k'), put_state_dict('k', version=3)."""
    shown = "" if version is _ANY else f", version={version!r}"
    return f"{_CALLED.get()}('{key}'{shown})"
