"""Ctrl-C, SIGTERM and SIGHUP as a flag that loops check, instead of an exception at a
random bytecode.

:func:`install` (the command line, main thread) makes each of these signals set the
flag and remembers which came first: ``timeout``, Slurm, Kubernetes and a closed
terminal stop a command the way Ctrl-C does, with one line and the shell's exit code
128 + N (130 SIGINT, 143 SIGTERM, 129 SIGHUP). A signal the parent process ignored
(``nohup``, a script's ``&``) stays ignored. :func:`check` raises
:class:`~gradstat.errors.Interrupted` once the flag is set. The unit runner checks between
units and at each part a unit reports; code no loop covers (imports, plots, a capture
waiting for its learners) gets Python's own ``KeyboardInterrupt`` while no analysis is
:func:`listening`, and the command line checks the flag at the end. Worker processes
ignore these signals and follow the parent's stop event (:func:`follow_event`).

Once the command is done, :func:`finishing` turns a late signal into the same one line
and exit code at once, and the process leaves right after the ``atexit`` handlers
(:func:`leave_after_atexit`): Python restores the default handlers before it tears its
modules down, which takes up to a second after torch and matplotlib, and a signal there
killed the process without a word.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gradstat.errors import Interrupted

#: The signals handled, and how the one line names each.
SIGNALS = {
    signal.SIGINT: "interrupted",
    signal.SIGTERM: "terminated (SIGTERM)",
    signal.SIGHUP: "hung up (SIGHUP)",
}

_requested = threading.Event()
_state: dict[str, Any] = {
    "listeners": 0,
    "event": None,
    "signal": None,
    "said": False,
    "code": None,
}


def _on_signal(signum: int, frame: Any) -> None:
    if _state["signal"] is None:
        _state["signal"] = signum
    _requested.set()
    if _state["listeners"] == 0:
        raise KeyboardInterrupt


def _on_late_signal(signum: int, frame: Any) -> None:
    if _state["signal"] is None:
        _state["signal"] = signum
    if not _state["said"]:
        os.write(2, f"Error: {stopped_text()}\n".encode())
    os._exit(exit_code())


def install() -> dict[int, Any]:
    """Make SIGINT, SIGTERM and SIGHUP set the flag, unless ignored (call from the main
    thread); returns the handlers they had, for :func:`restore`."""
    previous = {}
    for signum in SIGNALS:
        handler = signal.getsignal(signum)
        if handler is not signal.SIG_IGN:
            previous[signum] = handler
            signal.signal(signum, _on_signal)
    return previous


def restore(previous: dict[int, Any]) -> None:
    """Put back the handlers :func:`install` replaced (a command run in-process)."""
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def finishing(code: int, said: bool) -> None:
    """The command is done, to exit with ``code`` (``said``: its ``Error:`` line is
    printed): a signal from now on prints one line (none if one was said) and exits
    with its own code at once."""
    _state["said"], _state["code"] = said, code
    for signum in SIGNALS:
        if signal.getsignal(signum) is _on_signal:
            signal.signal(signum, _on_late_signal)


def leave_after_atexit() -> None:
    """Register (first, so it runs last) the exit with :func:`finishing`'s code once
    every other ``atexit`` handler has run, before the interpreter's teardown (the
    command line's own process only: files are closed, streams are flushed here)."""
    atexit.register(_leave)


def _leave() -> None:
    if _state["code"] is None:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing more to say
            stream.flush()
    os._exit(_state["code"])


def stop_signal() -> int:
    """The signal that stopped the command (SIGINT when none came: a plain Ctrl-C)."""
    return _state["signal"] or signal.SIGINT


def stopped_text() -> str:
    """How the one line says what stopped the command: ``interrupted``, ..."""
    return SIGNALS.get(stop_signal(), "interrupted")


def exit_code() -> int:
    """The shell's exit code of the stopping signal: 128 + its number."""
    return 128 + int(stop_signal())


def requested() -> bool:
    """Whether a stopping signal came here or, in a worker, to its parent."""
    event = _state["event"]
    return _requested.is_set() or (event is not None and event.is_set())


def check() -> None:
    """Raise :class:`Interrupted` if a stopping signal came."""
    if requested():
        raise Interrupted(stopped_text())


def reset() -> None:
    """Forget a stopping signal (a notebook or a test that goes on)."""
    _requested.clear()
    _state["signal"] = None
    _state["said"] = False


@contextmanager
def listening() -> Iterator[None]:
    """While analysis loops run: the signals only set the flag."""
    _state["listeners"] += 1
    try:
        yield
    finally:
        _state["listeners"] -= 1


def follow_event(event: Any) -> None:
    """In a worker process: ignore the signals, stop when the parent sets ``event``."""
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    _state["event"] = event
