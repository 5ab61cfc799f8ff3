"""Where a replay keeps its per-learner error-feedback memories: in RAM or in a scratch file.

Residual error feedback keeps one row per learner and compressor (DGC two: its momentum
``u`` and accumulation ``v``): ``learners x numel x 4`` bytes each, inherent to the
method. :class:`RamRows` holds them in one tensor. When they do not fit the memory
budget, :class:`ScratchRows` keeps them in a scratch file and reads and writes one
learner's row at a time (``pread``/``pwrite``): the process holds one row, the kernel's
page cache the rest as far as memory allows. The file lives in ``$GRADSTAT_SCRATCH``,
else ``$TMPDIR``, else ``/tmp`` (use a disk, not a tmpfs, for it to save memory) and has
no name: ``tempfile.TemporaryFile`` opens it with ``O_TMPFILE`` (or unlinks it the moment
it is made where that flag is missing), so the kernel reclaims it when the process
closes it or dies, by SIGKILL too; nothing of a replay is left in the folder. A row
never written reads as zeros (a sparse file), which is where every memory starts.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from gradstat.errors import DataError, UsageError
from gradstat.sizes import format_bytes

#: Environment variable naming the folder for scratch files.
SCRATCH_ENV = "GRADSTAT_SCRATCH"


class RamRows:
    """``rows x numel`` float32 rows in memory, zero at first.

    The rows are zeroed by a thread of their own, in order, while the caller works on the
    rows before: a fresh row's page faults cost about as much as a pass over it (16 rows
    of 8M values: 0.28 s of a 1.1 s replay of three steps, all on the replay's thread),
    and the replay's second core mostly waits for HDF5 reads. :meth:`load` waits for its
    row."""

    def __init__(self, rows: int, numel: int) -> None:
        self.data = torch.empty(rows, numel)
        self._zeroed = [threading.Event() for _ in range(rows)]
        self._failure: BaseException | None = None
        self._closing = False
        self._zeroing = threading.Thread(target=self._zero, name="gradstat-zero", daemon=True)
        self._zeroing.start()

    def _zero(self) -> None:
        try:
            for row, zeroed in enumerate(self._zeroed):
                if self._closing:
                    return
                self.data[row].zero_()
                zeroed.set()
        except BaseException as exc:  # handed to the caller by load
            self._failure = exc
            for zeroed in self._zeroed:
                zeroed.set()

    def load(self, row: int) -> torch.Tensor:
        """Row ``row``; a view, so writing into it and :meth:`save` cost nothing."""
        self._zeroed[row].wait()
        if self._failure is not None:
            raise self._failure
        return self.data[row]

    def save(self, row: int, values: torch.Tensor) -> None:
        """Make row ``row`` equal ``values``."""
        target = self.load(row)
        if values.data_ptr() != target.data_ptr():
            target.copy_(values)

    def close(self) -> None:
        self._closing = True  # the rows not yet zeroed are not needed any more
        self._zeroing.join()
        self.data = torch.zeros(0)
        if self._failure is None:  # a load from now on is an error, not a wait forever
            self._failure = RuntimeError("the memory rows were closed")
        for zeroed in self._zeroed:
            zeroed.set()


class ScratchRows:
    """``rows x numel`` float32 rows in a nameless file of ``folder``, one row in memory
    at a time."""

    def __init__(self, rows: int, numel: int, folder: Path) -> None:
        self.numel = numel
        self.row_bytes = numel * 4
        self.folder = Path(folder)
        try:
            self._file = tempfile.TemporaryFile(dir=folder)  # noqa: SIM115 (closed in close)
        except OSError as exc:
            raise UsageError(
                f"scratch folder {folder}: cannot create a file there ({exc.strerror}); "
                f"set {SCRATCH_ENV} to a writable folder on a disk"
            ) from None
        self.fd = self._file.fileno()
        os.ftruncate(self.fd, rows * self.row_bytes)

    def load(self, row: int) -> torch.Tensor:
        """A fresh copy of row ``row`` (write it back with :meth:`save`)."""
        out = np.empty(self.numel, dtype=np.float32)
        view = memoryview(out).cast("B")
        done = 0
        while done < self.row_bytes:
            got = os.preadv(self.fd, [view[done:]], row * self.row_bytes + done)
            if got <= 0:
                raise DataError(f"scratch file in {self.folder}: short read of row {row}")
            done += got
        return torch.from_numpy(out)

    def save(self, row: int, values: torch.Tensor) -> None:
        data = memoryview(values.detach().contiguous().numpy()).cast("B")
        done = 0
        try:
            while done < self.row_bytes:
                done += os.pwrite(self.fd, data[done:], row * self.row_bytes + done)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            free = format_bytes(shutil.disk_usage(self.folder).free)
            raise DataError(
                f"scratch folder {self.folder} is full ({free} free; {exc.strerror}): the "
                f"error-feedback memories did not fit; set {SCRATCH_ENV} to a larger disk "
                "or give --memory more"
            ) from None

    def close(self) -> None:
        if self.fd >= 0:
            self._file.close()
            self.fd = -1


def scratch_folder() -> Path:
    """Where scratch files go: ``$GRADSTAT_SCRATCH``, else ``$TMPDIR``, else ``/tmp``."""
    return Path(os.environ.get(SCRATCH_ENV) or tempfile.gettempdir())


class MemoryRows:
    """Allocates the row stores of one replay and closes them on close.

    ``scratch``: keep every store in a scratch file instead of RAM (see the module
    docstring; ``folder`` is where its files are, without names); use as a context
    manager so the stores go also on errors.
    """

    def __init__(self, scratch: bool) -> None:
        self.folder: Path | None = scratch_folder() if scratch else None
        self.stores: list[RamRows | ScratchRows] = []

    def new(self, rows: int, numel: int) -> RamRows | ScratchRows:
        """A zeroed ``rows x numel`` store."""
        store: RamRows | ScratchRows
        if self.folder is not None:
            store = ScratchRows(rows, numel, self.folder)
        else:
            store = RamRows(rows, numel)
        self.stores.append(store)
        return store

    def close(self) -> None:
        for store in self.stores:
            store.close()
        self.stores = []

    def __enter__(self) -> MemoryRows:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
