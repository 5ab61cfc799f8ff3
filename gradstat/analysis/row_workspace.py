"""Reading rows: a scope's block of one learner's row, and a reader that reads ahead.

:func:`read_block` is the one way an analysis reads a scope's columns of a row (checked
against their CRC-32C, into a buffer; never mapped: a file cut while it is read is an
error, not SIGBUS). :class:`Workspace` is a unit's reader with a reading thread that
reads the next learner's row while the row before it is processed (the compiled loops
leave the GIL): the replay's (:mod:`gradstat.analysis.replay_stream`) and the set
analyses' (:class:`gradstat.analysis.topk_stream.SetBuffers`; docs/large.md, "Fast
paths"). A unit opens one (``with Workspace() as space:``), keeps it from step to step
(a fresh row costs its page faults) and frees it when it ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from gradstat.store import Capture, Scope


def column_blocks(numel: int, block: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive blocks of at most ``block`` columns."""
    for start in range(0, numel, block):
        yield start, min(numel, start + block)


def scope_pieces(scope: Scope, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """Scope-local columns ``[start, stop)`` as ``(flat start, flat stop, local start)``."""
    local = 0
    for offset, numel in scope.slices:
        lo, hi = max(start, local), min(stop, local + numel)
        if lo < hi:
            yield offset + lo - local, offset + hi - local, lo
        local += numel


def read_block(
    cap: Capture, step: int, learner: int, scope: Scope, start: int, stop: int, out: np.ndarray
) -> np.ndarray:
    """The scope-local columns ``[start, stop)`` of one learner's row, read into ``out``."""
    pieces = list(scope_pieces(scope, start, stop))
    view = out[: stop - start]
    for flat_start, flat_stop, local in pieces:
        piece = view[local - start : local - start + flat_stop - flat_start]
        cap.read_row(step, learner, out=piece, columns=slice(flat_start, flat_stop))
    return view


def _then(
    after: Callable[[np.ndarray], Any], row_of: Callable[..., np.ndarray], *args: Any
) -> tuple[np.ndarray, Any]:
    """The row ``row_of(*args)`` gives (:func:`read_block`, or a read ahead's
    ``Future.result``: done, queued first on the same thread), and ``after`` of it."""
    row = row_of(*args)
    return row, after(row)


class Workspace:
    """A unit's row (or column block) buffers, allocated once, and a reading thread that
    reads the next learner's row into a free buffer (:func:`read_block`) while the
    caller works on the one before (CRC-32C checks and reads overlap the work). Reused
    while the width stays the same; a context manager that frees the buffers (and stops
    the thread) when it closes."""

    def __init__(self) -> None:
        self._width: int | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._ahead: tuple | None = None  # (row key, future, buffer) of a read-ahead
        self.buffers: tuple[np.ndarray, ...] = ()

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def ensure(self, width: int) -> None:
        """Buffers of ``width`` values: the row handed out and the one read behind it."""
        if width == self._width:
            return
        self._drop_ahead()
        self.buffers = ()  # free the old buffers before allocating new ones
        self.buffers = tuple(np.empty(width, dtype=np.float32) for _ in range(2))
        self._width = width

    def rows(
        self,
        cap: Capture,
        step: int,
        learners: Sequence[int],
        scope: Scope,
        start: int,
        stop: int,
        then: tuple[int, int, int] | None = None,
        after: Callable[[np.ndarray], Any] | None = None,
    ) -> Iterator[Any]:
        """Each learner's columns ``[start, stop)`` in turn, read in the background one row
        ahead of the caller; a row handed out stays valid until the next one is.
        ``then``: ``(step, start, stop)`` of the first learner's read likely asked for next
        (the next block or step), read ahead into a free buffer once this call's last row
        is queued; a later call for exactly that read takes it. ``after``: work the
        reading thread does on each row read; rows then come as (row, after(row))."""
        self._reader = self._reader or ThreadPoolExecutor(1, thread_name_prefix="gradstat-read")
        depth = 1  # reads in flight, and rows handed out that stay valid
        queue: deque[tuple[Future, int]] = deque()  # (read, buffer) in learner order
        handed: list[int] = []  # the buffers of the rows handed out, in order

        def read(
            at: int, learner: int, columns: tuple[int, int] = (start, stop), ahead: bool = False
        ) -> tuple[Future, int]:
            into = self._free_buffer(handed[-depth:] + [b for _, b in queue])
            block = (cap, at, learner, scope, *columns, self.buffers[into])
            if after is None or ahead:
                return self._reader.submit(read_block, *block), into
            return self._reader.submit(_then, after, read_block, *block), into

        wanted = (str(cap.path), step, learners[0], scope, start, stop)
        queue.append(self._take_ahead(wanted, after) or read(step, learners[0]))
        queued = 1  # learners whose read is queued
        try:
            for _ in learners:
                future, into = queue.popleft()
                handed.append(into)  # from here its buffer is the caller's
                while len(queue) < depth and queued < len(learners):
                    queue.append(read(step, learners[queued]))
                    queued += 1
                if len(queue) < depth and then is not None and self._ahead is None:
                    at, columns = then[0], then[1:]
                    key = (str(cap.path), at, learners[0], scope, *columns)
                    self._ahead = (key, *read(at, learners[0], columns, ahead=True), cap)
                result = future.result()
                yield result  # the next reads are queued behind it meanwhile
        finally:  # a read in flight must not land in a buffer someone reuses
            wait([future for future, _ in queue])

    def _free_buffer(self, in_use: list[int]) -> int:
        """A buffer neither ``in_use`` nor the read ahead's."""
        if self._ahead is not None:
            in_use = [*in_use, self._ahead[2]]
        return next(b for b in range(len(self.buffers)) if b not in in_use)

    def _take_ahead(self, wanted: tuple, after: Callable | None) -> tuple[Future, int] | None:
        """The read ahead, if it is the ``wanted`` row (with ``after`` queued behind it on
        the one reading thread); else None, and a read ahead of another row is let land
        and dropped."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead[0] != wanted:
            wait([ahead[1]])  # let it land (a failed one is not this walk's error)
            return None
        future, into = ahead[1:3]
        if after is not None:
            future = self._reader.submit(_then, after, future.result)
        return future, into

    def _drop_ahead(self) -> None:
        """Wait for a read-ahead to land and forget it (a failed one is not an error)."""
        if self._ahead is not None:
            wait([self._ahead[1]])
            self._ahead = None

    def release(self) -> None:
        """Free the buffers and stop the reading thread (both come back when needed)."""
        self._drop_ahead()
        self._width = None
        self.buffers = ()
        if self._reader is not None:
            self._reader.shutdown()
            self._reader = None
