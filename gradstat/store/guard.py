"""Run a metadata read in a forked child, so that a damaged file cannot hang gradstat.

HDF5 can loop on damaged metadata: in SWMR-read mode it retries every metadata read
whose checksum fails, with growing sleeps, for many minutes (it takes the damage for a
writer's half-finished update), and a zeroed global heap can make it spin. Neither
returns to Python, so neither a timeout nor Ctrl-C can stop it in-process. gradstat
therefore reads a capture's metadata (:mod:`gradstat.store.index`) in a child made by
``fork`` (about 20 ms), which sends its result back through a pipe (pickle, between
gradstat's own processes only) and is killed when it takes longer than ``timeout``
seconds, or when the user presses Ctrl-C (or the command gets SIGTERM or SIGHUP); a
child whose parent died (SIGKILL) is killed by a watcher of its own at once. The child
also tells which file it is reading, so that the error names it.

Where ``fork`` does not exist (Windows) the read runs in this process. Threads reading
rows while the child forks are safe: h5py 3.14 and later take their global lock around
``fork`` (h5py's "What's new in 3.14", pull request 2585), so no thread is inside HDF5
when the child starts.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gradstat.errors import DataError

T = TypeVar("T")
#: Seconds one file's metadata may take to read (``GRADSTAT_OPEN_TIMEOUT`` overrides).
OPEN_TIMEOUT = 15.0
#: Seconds between the watcher's looks at whether the child it watches is still there.
PARENT_POLL_SECONDS = 0.2
_HEADER = struct.Struct("<cQ")
_reporter: Callable[[str], None] | None = None


def open_timeout() -> float:
    """The limit for reading one file's metadata, in seconds."""
    try:
        return float(os.environ.get("GRADSTAT_OPEN_TIMEOUT", OPEN_TIMEOUT))
    except ValueError:
        return OPEN_TIMEOUT


def reading(what: str) -> None:
    """Say (from inside :func:`bounded`) which file is being read now."""
    if _reporter is not None:
        _reporter(what)


def bounded(fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
    """``fn(*args)`` computed in a forked child; its exceptions are raised here. A child
    that spends over ``timeout`` seconds on one file (:func:`reading` starts the next)
    or dies by a signal is a ``DataError`` naming the file it was reading."""
    if not hasattr(os, "fork"):
        return fn(*args)
    limit = open_timeout() if timeout is None else timeout
    read_end, write_end = os.pipe()
    alive_end, held_end = os.pipe()  # this process holds held_end: closed when it dies
    pid = os.fork()  # h5py (>= 3.14) holds its lock across fork: no thread is mid-HDF5
    if pid == 0:  # the child: compute, send, leave without running the parent's cleanup
        code = 0
        try:
            os.close(read_end)
            os.close(held_end)
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(signum, signal.SIG_IGN)  # the parent handles them, kills this
            _watch_parent(alive_end)
            _child(fn, args, write_end)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    os.close(alive_end)
    try:
        return _wait(pid, read_end, limit)
    finally:
        os.close(read_end)
        os.close(held_end)


def _watch_parent(alive_end: int) -> None:
    """In the child: fork a watcher that kills this child when the parent is gone
    (killed by SIGKILL, it cannot kill the child, and HDF5 may loop here for minutes
    holding the GIL, so no thread of the child could notice). The watcher sees the end
    of ``alive_end`` once the parent's end is closed, and ends with the child."""
    child = os.getpid()
    if os.fork() != 0:
        os.close(alive_end)
        return
    try:  # the watcher: nothing but waiting
        while os.getppid() == child:
            if select.select([alive_end], [], [], PARENT_POLL_SECONDS)[0]:
                os.kill(child, signal.SIGKILL)
                break
    finally:
        os._exit(0)


def _child(fn: Callable[..., Any], args: tuple, fd: int) -> None:
    global _reporter

    def send(tag: bytes, payload: bytes) -> None:
        data = _HEADER.pack(tag, len(payload)) + payload
        while data:
            data = data[os.write(fd, data) :]

    _reporter = lambda what: send(b"P", what.encode())  # noqa: E731
    try:
        result = (True, fn(*args))
    except Exception as exc:  # sent back and raised in the parent
        result = (False, exc)
    try:
        payload = pickle.dumps(result)
    except Exception as exc:  # an exception that does not pickle: its text
        payload = pickle.dumps((False, DataError(f"{type(exc).__name__}: {exc}")))
    send(b"R", payload)


def _wait(pid: int, fd: int, limit: float) -> Any:
    deadline = time.monotonic() + limit
    buffer, current, result = b"", "the capture", None
    try:
        while result is None:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, min(left, 0.5)))[0] if left > 0 else []
            if not ready:
                if time.monotonic() < deadline:
                    continue
                raise DataError(
                    f"{current}: reading its metadata did not finish within {limit:g} s "
                    "(damaged HDF5 metadata?)"
                )
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            buffer += chunk
            while len(buffer) >= _HEADER.size:
                tag, size = _HEADER.unpack_from(buffer)
                if len(buffer) < _HEADER.size + size:
                    break
                payload = buffer[_HEADER.size : _HEADER.size + size]
                buffer = buffer[_HEADER.size + size :]
                if tag == b"P":  # the next file: its own time limit
                    current = payload.decode()
                    deadline = time.monotonic() + limit
                else:
                    result = pickle.loads(payload)
    except BaseException:
        _kill(pid)
        raise
    _, status = os.waitpid(pid, 0)
    if result is None:
        how = (
            f"signal {signal.Signals(os.WTERMSIG(status)).name}"
            if os.WIFSIGNALED(status)
            else f"exit {os.WEXITSTATUS(status)}"
        )
        raise DataError(f"{current}: HDF5 failed while reading its metadata ({how})")
    ok, value = result
    if not ok:
        raise value
    return value


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
