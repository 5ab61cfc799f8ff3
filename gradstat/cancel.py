"""Ctrl-C as a flag that loops check, instead of an exception at a random bytecode.

:func:`install` (the command line, main thread) makes SIGINT set the flag; :func:`check`
raises :class:`~gradstat.errors.Interrupted` once it is set. The unit runner checks
between units and at each part a unit reports; code no loop covers (imports, plots, a
capture waiting for its learners) gets Python's own ``KeyboardInterrupt`` while no
analysis is :func:`listening`, and the command line checks the flag at the end. Worker
processes ignore SIGINT and follow the parent's stop event (:func:`follow_event`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gradstat.errors import Interrupted

_requested = threading.Event()
_state: dict[str, Any] = {"listeners": 0, "event": None}


def _on_sigint(signum: int, frame: Any) -> None:
    _requested.set()
    if _state["listeners"] == 0:
        raise KeyboardInterrupt


def install() -> None:
    """Make SIGINT set the flag (call from the main thread)."""
    signal.signal(signal.SIGINT, _on_sigint)


def requested() -> bool:
    """Whether Ctrl-C was pressed here or, in a worker, in its parent."""
    event = _state["event"]
    return _requested.is_set() or (event is not None and event.is_set())


def check() -> None:
    """Raise :class:`Interrupted` if Ctrl-C was pressed."""
    if requested():
        raise Interrupted("interrupted")


def reset() -> None:
    """Forget a Ctrl-C (a notebook or a test that goes on)."""
    _requested.clear()


@contextmanager
def listening() -> Iterator[None]:
    """While analysis loops run: SIGINT only sets the flag."""
    _state["listeners"] += 1
    try:
        yield
    finally:
        _state["listeners"] -= 1


def follow_event(event: Any) -> None:
    """In a worker process: ignore SIGINT, stop when the parent sets ``event``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _state["event"] = event
