"""The background writer: moves recorded rows from training to the rank file.

Training hands over a filled buffer and goes on; this thread waits for the (possibly
asynchronous, GPU -> pinned host) copy to finish, appends the row and gives the buffer
back to the pool. A failing disk never stops training: the first error is reported once,
recording stops, and the file keeps every row committed before the failure.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import resource
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gradstat.errors import GradstatWarning
from gradstat.store.dtypes import buffer_to_disk
from gradstat.store.writer import META_BLOCK_BYTES, RankFileWriter

#: Space kept free beside each row for HDF5 metadata: the chunk index grows by blocks,
#: and every 1024 rows /step, /loss and /crc32c get a new chunk (20 KiB together).
METADATA_MARGIN_BYTES = 1 << 20


#: Free bytes needed to write the ``stopped`` note into a rank file: the new attribute
#: and its metadata block (``META_BLOCK_BYTES``), generously.
NOTE_ROOM_BYTES = 4 * META_BLOCK_BYTES


def space_needed(row_bytes: int) -> int:
    """Bytes that must be free before a row is appended: the row, its chunk-index
    entries (~1/64 of the row at the smallest chunks, generous) and the metadata margin.
    Sized from the row, so small rows use the disk to its last megabyte (issue 12)."""
    return row_bytes + row_bytes // 64 + METADATA_MARGIN_BYTES


def space_left(path: Path) -> int:
    """Bytes this process may still add to ``path``: free disk space, capped by the
    file-size limit (RLIMIT_FSIZE) when one is set."""
    stat = os.statvfs(path.parent)
    free = stat.f_bavail * stat.f_frsize
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        free = min(free, limit - path.stat().st_size)
    return free


@dataclass
class PendingRow:
    """One recorded step on its way to disk."""

    step: int
    loss: float
    buffer: torch.Tensor
    ready: torch.cuda.Event | None  # set when the copies were asynchronous (GPU)
    sent: torch.Tensor | None = None  # a compression hook's contribution (docs/online.md)
    sent_bytes: float = float("nan")


def compression_meta(state) -> dict:
    """Root attributes that describe a gradstat compression hook (docs/format.md)."""
    return {
        "compressor": state.label,
        "compressor_ratio": float("nan") if state.ratio is None else float(state.ratio),
        "compressor_settings": json.dumps(state.settings()),
    }


class BackgroundWriter:
    """Appends rows to one rank file from a daemon thread (bounded queue, buffer pool)."""

    def __init__(
        self,
        path: Path,
        rank: int,
        numel: int,
        dtype: str,
        release: Callable[[torch.Tensor], None],
        max_queue: int = 4,
        compression: str = "none",
        sent: bool = False,
        run_id: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.rows_written = 0
        self.bytes_written = 0  # values of /grad (and /sent) written
        self.error: BaseException | None = None
        self._release = release
        self._queue: queue.Queue[PendingRow | None] = queue.Queue(max_queue)
        try:
            self._file: RankFileWriter | None = RankFileWriter(
                self.path, rank, numel, dtype, compression, sent=sent, run_id=run_id
            )
        except OSError as exc:
            self._file = None
            self._fail(exc)
        self._thread = threading.Thread(target=self._run, name="gradstat-writer", daemon=True)
        self._thread.start()

    @property
    def failed(self) -> bool:
        return self.error is not None

    def submit(self, row: PendingRow) -> None:
        """Queue a row (blocks while ``max_queue`` rows wait: memory stays bounded)."""
        if self.failed:
            self._release(row.buffer)
            if row.sent is not None:
                self._release(row.sent)
            return
        self._queue.put(row)

    def _fail(self, exc: BaseException, step: int | None = None) -> None:
        self.error = exc
        if step is not None and self._file is not None and self._room_for_a_note():
            full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG)
            reason = f"{'disk full' if full else 'write failed'} at step {step}"
            # the file is still sound: the writer stopped before the disk filled
            with contextlib.suppress(Exception):
                self._file.mark_stopped(reason)
        warnings.warn(
            f"gradstat stopped recording to {self.path} after {self.rows_written} rows: {exc}. "
            "Training goes on; the file keeps the rows committed so far.",
            GradstatWarning,
            stacklevel=2,
        )

    def _room_for_a_note(self) -> bool:
        """Whether the disk still has room for the ``stopped`` note. A new attribute is
        new HDF5 metadata: written onto a disk with no room at all, it is cut short and
        damages the file's attribute heap (measured on a full tmpfs), so the committed
        rows would no longer open. Without the room the file keeps its rows, unmarked."""
        try:
            return space_left(self.path) >= NOTE_ROOM_BYTES
        except OSError:
            return False

    def _ensure_space(self, row_bytes: int) -> None:
        """Stop *before* the disk fills: HDF5 cannot close a file it failed to extend."""
        left = space_left(self.path)
        if left < space_needed(row_bytes):
            raise OSError(
                errno.ENOSPC, f"disk full: {left:,} bytes left, a row needs {row_bytes:,}"
            )

    def _run(self) -> None:
        while (row := self._queue.get()) is not None:
            try:
                if not self.failed and self._file is not None:
                    if row.ready is not None:
                        row.ready.synchronize()
                    row_bytes = sum(
                        t.numel() * t.element_size()
                        for t in (row.buffer, row.sent)
                        if t is not None
                    )
                    self._ensure_space(row_bytes)
                    sent = None if row.sent is None else buffer_to_disk(row.sent)
                    self._file.append(
                        row.step, row.loss, buffer_to_disk(row.buffer), sent, row.sent_bytes
                    )
                    self.rows_written += 1
                    self.bytes_written += row_bytes
            except Exception as exc:  # disk full, permission, quota: stop, never crash
                self._fail(exc, row.step)
            finally:
                self._release(row.buffer)
                if row.sent is not None:
                    self._release(row.sent)
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until every submitted row is written (or dropped after a failure)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, stop the thread and close the file."""
        self._queue.put(None)
        self._thread.join()
        if self._file is not None:
            try:
                self._file.close()
            except Exception as exc:
                if not self.failed:
                    self._fail(exc)
