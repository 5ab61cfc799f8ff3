"""Rows of an unfiltered chunked dataset read straight from the file, past HDF5's copy.

HDF5 reads a row of ``/grad`` chunk by chunk (1 MiB chunks, ``MAX_CHUNK_BYTES``): per
chunk a B-tree lookup and a copy through its hyperslab machinery. Where the dataset has
no filters (no compression), one row per chunk and a native type, HDF5 is asked only
where each chunk of the row lies (``H5Dget_chunk_info_by_coord``), and runs of chunks
that follow each other in the file are read with ``os.preadv`` straight into the
caller's buffer. The bytes are the ones HDF5 would copy (tests compare the two paths,
``dataset.read_direct`` being the reference); the caller checks them against their
checksums either way. Anything else (a filter, an unallocated chunk, a short read at a
truncated end, a platform without ``preadv``) leaves the read to HDF5.

Nothing is mapped: a file truncated while it is read gives a short read here (and a
checksum error after HDF5's read), never SIGBUS.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np

#: Most bytes one ``preadv`` call is asked for (Linux reads at most 2 GiB - 4 KiB).
_MAX_READ = 1 << 30


class DirectRows:
    """Direct reads of one dataset's rows (see the module docstring); :meth:`read`
    answers False where HDF5 must read instead."""

    def __init__(self, path: Path, dataset: h5py.Dataset) -> None:
        self.dataset = dataset
        self.dtype = dataset.dtype
        self.chunk_cols = dataset.chunks[1]
        # HDF5's own descriptor where its driver is the plain POSIX one (``sec2`` reads
        # with ``pread`` too, so neither moves the other's offset); else one of its own
        self._owned = dataset.file.driver != "sec2"
        self._fd: int | None = (
            os.open(path, os.O_RDONLY) if self._owned else dataset.file.id.get_vfd_handle()
        )

    @classmethod
    def usable(cls, path: Path, dataset: h5py.Dataset) -> DirectRows | None:
        """A reader for ``dataset``, or None when its layout needs HDF5."""
        if not hasattr(os, "preadv") or not _plain_rows(dataset):
            return None
        return cls(path, dataset)

    def read(self, row: int, start: int, stop: int, out: np.ndarray) -> bool:
        """Read columns ``[start, stop)`` of ``row`` into ``out`` (contiguous, of the
        dataset's type); False, with ``out`` in an undefined state, where it cannot."""
        if self._fd is None or out.dtype != self.dtype or not out.flags.c_contiguous:
            return False
        runs = self._runs(row, start, stop) if stop > start else None
        if runs is None:
            return False
        target = memoryview(out).cast("B")
        itemsize = self.dtype.itemsize
        for file_offset, first, end in runs:
            run = target[(first - start) * itemsize : (end - start) * itemsize]
            for at in range(0, len(run), _MAX_READ):
                piece = run[at : at + _MAX_READ]
                if os.preadv(self._fd, [piece], file_offset + at) != len(piece):
                    return False  # past the end of a truncated file: HDF5 says what
        return True

    def _runs(self, row: int, start: int, stop: int) -> list[tuple[int, int, int]] | None:
        """(file offset, first column, end column) of each run of adjacent chunks
        holding columns ``[start, stop)`` of ``row``; None if a chunk is not on disk."""
        width, itemsize = self.chunk_cols, self.dtype.itemsize
        runs: list[tuple[int, int, int]] = []
        for chunk in range(start // width, (stop - 1) // width + 1):
            try:
                info = self.dataset.id.get_chunk_info_by_coord((row, chunk * width))
            except (OSError, RuntimeError, ValueError):  # e.g. a row past the extent
                return None
            if info.byte_offset is None or info.size != width * itemsize:
                return None
            first = max(start, chunk * width)
            last = min(stop, (chunk + 1) * width)
            offset = info.byte_offset + (first - chunk * width) * itemsize
            if runs and runs[-1][0] + (runs[-1][2] - runs[-1][1]) * itemsize == offset:
                runs[-1] = (runs[-1][0], runs[-1][1], last)  # the chunk follows the run
            else:
                runs.append((offset, first, last))
        return runs

    def close(self) -> None:
        """Stop reading (and close the descriptor if it is this reader's own)."""
        if self._fd is not None and self._owned:
            os.close(self._fd)
        self._fd = None


def _plain_rows(dataset: h5py.Dataset) -> bool:
    """A 2-D dataset stored in unfiltered chunks of one row each, of a native type."""
    chunks = dataset.chunks
    return (
        dataset.ndim == 2
        and chunks is not None
        and chunks[0] == 1
        and dataset.dtype.isnative
        and dataset.id.get_create_plist().get_nfilters() == 0
        and hasattr(dataset.id, "get_chunk_info_by_coord")
    )
