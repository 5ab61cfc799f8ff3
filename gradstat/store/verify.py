"""Verifying rank files: damaged data is an error naming file, learner and step.

Two checks, so that a damaged file never reads as data (docs/format.md, "Integrity"):

* **Structure** (metadata only, at every open): a file must be as long as HDF5 says
  (``H5Fget_filesize``: the end of allocation, past every chunk). When it is shorter,
  or has no checksums (schema 1), each committed row's chunks must be allocated and lie
  inside the file as it is on disk, which names the damaged rows. A truncated copy keeps
  its chunk index, and HDF5 reads chunks past the end of the file as zeros without an
  error (measured with HDF5 2.0, also with the Fletcher-32 filter), so this check is
  what catches truncation. It costs one ``stat`` when the size is right; the per-chunk
  scan (a Python call per chunk) runs only on short files and schema 1.
* **Content** (schema 2, on every row read): ``/crc32c[i]`` is the CRC-32C (Castagnoli,
  the checksum of iSCSI, ext4 and Btrfs; ``crc32c.crc32c`` in Python) of row ``i`` of
  ``/grad`` as stored: its little-endian bytes in the file's dtype, before any HDF5
  filter. Stored apart from the row, it also catches rows zeroed by a file system after
  a crash, which a per-chunk Fletcher-32 (zero data, zero sum) would accept. CRC-32C
  rather than zlib's CRC-32: the CPU computes it in hardware (SSE 4.2, ARMv8), 28 GB/s
  against zlib's 4 GB/s here, so checking every row read costs little
  (benchmarks/integrity_cost.py).

Schema 1 files have no ``/crc32``: their rows are verified by the structure check only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from crc32c import crc32c

from gradstat.errors import DataError

#: Name of the per-row checksum dataset (schema 2).
CHECKSUM_DATASET = "crc32c"


def row_checksum(row: np.ndarray, value: int = 0) -> int:
    """CRC-32C of one row's bytes as stored (little-endian, the row's own dtype);
    ``value``: the CRC-32C of the bytes before them (a row checked in column blocks)."""
    data = np.ascontiguousarray(row)
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    return crc32c(data.reshape(-1).view(np.uint8), value)


@dataclass(frozen=True)
class Damage:
    """Rows of one learner's file that cannot be trusted, and why."""

    path: Path
    learner: int
    rows: tuple[int, ...]  # indices into the file's rows; empty: the whole file
    reason: str

    def describe(self, steps: np.ndarray | None = None) -> str:
        """``rank-00001.h5 (learner 1): steps 5..9 damaged: <reason>``."""
        where = f"{self.path} (learner {self.learner})"
        if not self.rows:
            return f"{where}: damaged: {self.reason}"
        labels = (
            [int(steps[r]) for r in self.rows if r < len(steps)]
            if steps is not None and len(steps)
            else []
        )
        what = "steps" if len(labels) == len(self.rows) else "rows"
        values = labels if what == "steps" else list(self.rows)
        return f"{where}: {what} {span_text(values)} damaged: {self.reason}"


def span_text(values: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``1..3, 7`` (the rows or steps of a damage report)."""
    parts: list[str] = []
    start = prev = None
    for value in values:
        if prev is not None and value == prev + 1:
            prev = value
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}..{prev}")
        start = prev = value
    if start is not None:
        parts.append(str(start) if start == prev else f"{start}..{prev}")
    return ", ".join(parts)


def _rows_outside(dataset: h5py.Dataset, rows: int, file_size: int) -> set[int]:
    """Committed rows (< ``rows``) with a chunk that is unallocated or past the file end."""
    if rows == 0:
        return set()
    per_row = -(-dataset.shape[1] // dataset.chunks[1]) if dataset.ndim == 2 else None
    present: dict[int, int] = {}
    bad: set[int] = set()

    def visit(info) -> None:
        first = int(info.chunk_offset[0])
        span = dataset.chunks[0]
        inside = info.byte_offset is not None and info.byte_offset + info.size <= file_size
        for row in range(first, min(first + span, rows)):
            present[row] = present.get(row, 0) + 1
            if not inside:
                bad.add(row)

    dataset.id.chunk_iter(visit)
    if per_row is not None:
        bad |= {row for row in range(rows) if present.get(row, 0) < per_row}
    else:
        bad |= {row for row in range(rows) if row not in present}
    return bad


def structural_damage(f: h5py.File, path: Path, learner: int, rows: int) -> Damage | None:
    """Check that the ``rows`` committed rows of an open rank file are all on disk."""
    file_size = path.stat().st_size
    claimed = f.id.get_filesize()
    if file_size >= claimed and CHECKSUM_DATASET in f:
        return None  # every chunk lies inside; their contents answer to the checksums
    try:
        bad: set[int] = set()
        names = ["grad", "step", "loss"]
        if CHECKSUM_DATASET in f:
            names.append(CHECKSUM_DATASET)
        for name in names:
            bad |= _rows_outside(f[name], rows, file_size)
    except (OSError, RuntimeError, KeyError) as exc:
        return Damage(path, learner, (), f"its chunk index cannot be read ({exc})")
    truncated = f"the file holds {file_size:,} of the {claimed:,} bytes HDF5 recorded (truncated?)"
    if bad:
        reason = "chunks missing or past the end of the file"
        if file_size < claimed:
            reason += f"; {truncated}"
        return Damage(path, learner, tuple(sorted(bad)), reason)
    if bool(f.attrs.get("closed", False)) and file_size < claimed:
        return Damage(path, learner, (), truncated)
    return None


def check_row(
    path: Path,
    learner: int,
    step: int,
    row: np.ndarray,
    expected: int | None,
    actual: int | None = None,
) -> None:
    """Raise ``DataError`` when a row read from ``path`` does not match its checksum
    (``actual``: the row's CRC-32C where the read already computed it)."""
    if expected is None:
        return
    if actual is None:
        actual = row_checksum(row)
    if actual != expected:
        raise DataError(
            f"{path} (learner {learner}): step {step} is damaged "
            f"(CRC-32C {actual:08x}, recorded {expected:08x})"
        )
