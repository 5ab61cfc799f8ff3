"""Checked reads of one rank file's rows: any column range, verified by its checksums.

A row's values are covered by CRC-32Cs of blocks of ``block`` values (schema 3: one per
chunk, ``/grad_crc32c``; schema 2: one per row, ``/crc32c``, so ``block`` is the row).
A read of columns ``[start, stop)`` reads the blocks that lie wholly inside straight
into the caller's buffer and checks each; a block cut by ``start`` or ``stop`` is read
whole, piece by piece, into a small buffer, checked, and the wanted part copied out.
So every value handed out was checked, whatever the column range (a ``--scope`` regex,
column blocks in any order); the only state kept between reads is the last row's
checksums (a row read in column blocks reads them once, not once a block: 0.2-0.5 ms a
read through h5py). Schema 1 files have no
checksums: their rows rest on the structure check alone (gradstat/store/verify.py).
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from gradstat.errors import DamagedData
from gradstat.store.checksums import row_checksum

#: Values read per piece of a block cut by the column range (schema 2: the whole row).
PIECE_VALUES = 1 << 20


class RowSource:
    """The rows of one dataset (``/grad`` or ``/sent``) of one rank file, as stored.

    ``checksums``: the dataset of their CRC-32Cs, ``(rows, blocks)`` or ``(rows,)`` for
    one per row, or None (schema 1); ``block``: values per checksum. Values are read by
    HDF5's ``read_direct`` into the caller's buffer (nothing is mapped: a file cut under
    a read is a ``DataError``, never SIGBUS).
    """

    def __init__(
        self,
        path: Path,
        learner: int,
        dataset: h5py.Dataset,
        checksums: h5py.Dataset | None,
        block: int | None,
    ) -> None:
        self.path, self.learner, self.dataset = path, learner, dataset
        self.numel = int(dataset.shape[1])
        self.checksums = checksums
        self.block = block or self.numel
        self._last: tuple[int, np.ndarray] | None = None  # (row, its checksums)

    def read(self, row: int, step: int, start: int, stop: int, out: np.ndarray) -> None:
        """Columns ``[start, stop)`` of ``row`` (training step ``step``) as stored, into
        ``out`` (contiguous, native order, the dataset's type), checked: a damaged
        row is a ``DataError`` naming file, learner and step."""
        if stop <= start:
            return
        if self.checksums is None:
            self._raw(row, step, start, stop, out)
            return
        expected = self._expected(row, step)
        b = self.block
        first, last = start // b, (stop - 1) // b
        lo = first if start % b == 0 else first + 1  # blocks wholly inside [start, stop)
        hi = last + 1 if stop % b == 0 or stop == self.numel else last
        if lo < hi:
            c0, c1 = lo * b, min(hi * b, self.numel)
            self._raw(row, step, c0, c1, out[c0 - start : c1 - start])
            for blk in range(lo, hi):
                a, z = blk * b, min((blk + 1) * b, self.numel)
                self._check(step, blk, row_checksum(out[a - start : z - start]), expected)
        for blk in sorted({first, last} - set(range(lo, hi))):
            self._cut_block(row, step, blk, start, stop, out, expected)

    def _expected(self, row: int, step: int) -> np.ndarray:
        last = self._last  # one read of the tuple: safe with a reading thread
        if last is not None and last[0] == row:
            return last[1]
        try:
            expected = np.atleast_1d(np.asarray(self.checksums[row], dtype=np.uint32))
        except (OSError, RuntimeError, ValueError) as exc:
            raise self._error(step, f"its checksums cannot be read ({exc})") from None
        self._last = (row, expected)
        return expected

    def _cut_block(
        self,
        row: int,
        step: int,
        blk: int,
        start: int,
        stop: int,
        out: np.ndarray,
        expected: np.ndarray,
    ) -> None:
        """Read block ``blk`` whole in pieces, check it, copy its part in ``[start, stop)``."""
        a, z = blk * self.block, min((blk + 1) * self.block, self.numel)
        scratch = np.empty(min(z - a, PIECE_VALUES), dtype=out.dtype)
        crc = 0
        for p0 in range(a, z, PIECE_VALUES):
            p1 = min(z, p0 + PIECE_VALUES)
            piece = scratch[: p1 - p0]
            self._raw(row, step, p0, p1, piece)
            crc = row_checksum(piece, crc)
            lo, hi = max(p0, start), min(p1, stop)
            if lo < hi:
                out[lo - start : hi - start] = piece[lo - p0 : hi - p0]
        self._check(step, blk, crc, expected)

    def _check(self, step: int, blk: int, actual: int, expected: np.ndarray) -> None:
        if blk >= expected.size or actual != int(expected[blk]):
            recorded = f"{int(expected[blk]):08x}" if blk < expected.size else "none"
            a, z = blk * self.block, min((blk + 1) * self.block, self.numel)
            raise self._error(
                step, f"CRC-32C of values {a}..{z - 1} is {actual:08x}, recorded {recorded}"
            )

    def _raw(self, row: int, step: int, start: int, stop: int, out: np.ndarray) -> None:
        try:
            self.dataset.read_direct(out, np.s_[row, start:stop])
        except (OSError, RuntimeError, ValueError, TypeError) as exc:
            raise self._error(step, f"cannot be read ({exc})") from None

    def _error(self, step: int, reason: str) -> DamagedData:
        name = self.dataset.name.lstrip("/")
        what = f"step {step}" if name == "grad" else f"step {step} of /{name}"
        return DamagedData(f"{self.path} (learner {self.learner}): {what} is damaged: {reason}")
