"""The structure check of rank files: every committed row lies inside the file.

A truncated copy keeps its chunk index, and HDF5 reads chunks past the end of a file as
zeros without an error (measured with HDF5 2.0, also with the Fletcher-32 filter), so
at every open a file must be as long as HDF5 says (``H5Fget_filesize``: the end of
allocation, past every chunk). When it is shorter, or has no checksums (schema 1), each
committed row's chunks (and the extent of contiguous datasets) must be allocated and
lie inside the file as it is on disk, which names the damaged rows. It costs one
``stat`` when the size is right; the per-chunk scan runs only on short files and
schema 1. What the rows hold answers to their checksums (gradstat/store/rows.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from gradstat.store.schema import GRAD_CRC, RECORD_CRC, ROW_CRC, SENT_CRC

#: Datasets whose committed rows must lie inside the file, where the file holds them.
_ROW_DATASETS = (
    "grad",
    "step",
    "loss",
    "sent",
    "sent_bytes",
    ROW_CRC,
    GRAD_CRC,
    SENT_CRC,
    RECORD_CRC,
)


@dataclass(frozen=True)
class Damage:
    """Rows of one learner's file that cannot be trusted, and why."""

    path: Path
    learner: int
    rows: tuple[int, ...]  # indices into the file's rows; empty: the whole file
    reason: str
    by_row: bool = False  # name rows, not steps (the steps themselves are in doubt)

    def describe(self, steps: np.ndarray | None = None) -> str:
        """``rank-00001.h5 (learner 1): steps 5..9 damaged: <reason>``."""
        where = f"{self.path} (learner {self.learner})"
        if not self.rows:
            return f"{where}: damaged: {self.reason}"
        labels = (
            [int(steps[r]) for r in self.rows if r < len(steps)]
            if steps is not None and len(steps) and not self.by_row
            else []
        )
        increasing = all(b > a for a, b in itertools.pairwise(labels))
        what = "step" if len(labels) == len(self.rows) and increasing else "row"
        values = labels if what == "step" else list(self.rows)
        what += "" if len(values) == 1 else "s"  # "step 9 damaged", "steps 9..12 damaged"
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
    if dataset.chunks is None:  # contiguous (or compact): one extent, all or nothing
        offset, size = dataset.id.get_offset(), dataset.id.get_storage_size()
        inside = (size == 0 and dataset.size == 0) or (
            offset is not None and offset + size <= file_size
        )
        return set() if inside else set(range(rows))
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


def structural_damage(
    f: h5py.File, path: Path, learner: int, rows: int, walk: bool = False
) -> Damage | None:
    """Check that the ``rows`` committed rows of an open rank file are all on disk;
    ``walk``: read every chunk index even when the file's size is right."""
    file_size = path.stat().st_size
    claimed = f.id.get_filesize()
    if file_size >= claimed and (GRAD_CRC in f or ROW_CRC in f) and not walk:
        return None  # every chunk lies inside; their contents answer to the checksums
    try:
        bad: set[int] = set()
        for name in _ROW_DATASETS:
            if name in f:
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
