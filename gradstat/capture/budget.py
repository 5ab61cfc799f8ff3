"""The disk budget: how many bytes a capture will write, checked before training starts.

A capture stores ``rows x learners x numel`` values (recorded steps, recorded learners,
recorded parameters), each ``bytes_per_value`` bytes, plus HDF5 metadata; training with
a compressor (``--compressor``) stores as many again, what each learner sent (``/sent``,
same shape and storage) and its payload bytes (``/sent_bytes``, 8 B a row). Measured with
h5py 3.16 / HDF5 2.0: about 88 KiB per file (24 KiB of headers, and the space the writer
sets aside for metadata in blocks of ``META_BLOCK_BYTES``, 1-1000 rows) and, per row,
under 1 KiB for the step, the loss and one chunk-index entry per <= 1 MiB chunk; the
constants below round those up.
Compression only shrinks files, so with it the estimate is an upper bound.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from gradstat.sizes import format_bytes
from gradstat.store.dtypes import bytes_per_value
from gradstat.store.schema import MAX_CHUNK_BYTES
from gradstat.store.writer import META_BLOCK_BYTES

#: HDF5 metadata per file (superblock, object headers, attributes: measured ~24 KiB) and
#: the metadata block the writer sets aside (measured ~88 KiB in all).
FILE_OVERHEAD_BYTES = (64 << 10) + META_BLOCK_BYTES
#: Per row: step (8 B), loss (8 B) and their chunk indexes, rounded up.
ROW_OVERHEAD_BYTES = 64
#: Per chunk of a row: one chunk-index entry, rounded up.
CHUNK_OVERHEAD_BYTES = 32
#: Per layer in capture.h5's layer table (name, offset, numel, shape), rounded up.
LAYER_OVERHEAD_BYTES = 256

CLI_SUGGESTION = (
    "record less: --every N (fewer steps), --layers REGEX (fewer parameters), "
    "--record-ranks SPEC (fewer learners) or --dtype bfloat16 (half the bytes)"
)
API_SUGGESTION = (
    "record less: every=N (fewer steps), layers=REGEX (fewer parameters), "
    "record_ranks=SPEC (fewer learners) or dtype='bfloat16' (half the bytes)"
)


@dataclass(frozen=True)
class CapturePlan:
    """What a capture will write into one folder."""

    rows: int  # recorded steps
    learners: int  # rank files in this folder
    numel: int  # recorded values per row
    dtype: str
    layers: int = 1
    root: bool = True  # whether capture.h5 is written here (rank 0's machine)
    sent: bool = False  # a compression hook's /sent rows beside /grad (docs/online.md)

    @property
    def row_bytes(self) -> int:
        """One learner's values of one step: the gradient row (and the sent row)."""
        return self.datasets * self.numel * bytes_per_value(self.dtype)

    @property
    def datasets(self) -> int:
        """Full-length rows stored per learner and step: /grad (and /sent)."""
        return 2 if self.sent else 1

    @property
    def data_bytes(self) -> int:
        """The values alone: rows x learners x numel x bytes per value (x 2 with /sent)."""
        return self.rows * self.learners * self.row_bytes

    @property
    def overhead_bytes(self) -> int:
        one_row = self.numel * bytes_per_value(self.dtype)
        chunks_per_row = self.datasets * -(-one_row // MAX_CHUNK_BYTES)
        per_row = ROW_OVERHEAD_BYTES * self.datasets + chunks_per_row * CHUNK_OVERHEAD_BYTES
        files = self.learners * (FILE_OVERHEAD_BYTES + self.rows * per_row)
        root = FILE_OVERHEAD_BYTES + self.layers * LAYER_OVERHEAD_BYTES if self.root else 0
        return files + root

    @property
    def expected_bytes(self) -> int:
        return self.data_bytes + self.overhead_bytes

    def describe(self) -> str:
        """E.g. ``1.2 GiB (100 rows x 4 learners x 137,000 values x 4 B + 0.3 MiB metadata)``."""
        sent = " x 2 (gradient and sent)" if self.sent else ""
        return (
            f"{format_bytes(self.expected_bytes)} ({self.rows} rows x {self.learners} "
            f"learners x {self.numel:,} values x {bytes_per_value(self.dtype)} B "
            f"({self.dtype}){sent} + {format_bytes(self.overhead_bytes)} HDF5 metadata)"
        )


def recorded_rows(total_steps: int, every: int, start: int) -> int:
    """Steps ``start, start + every, ...`` below ``total_steps``."""
    return len(range(start, total_steps, every))


def free_bytes(folder: Path) -> int:
    """Free space for an unprivileged user on the filesystem that holds (or will hold)
    ``folder``."""
    folder = Path(folder).absolute()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def budget_problem(
    plan: CapturePlan, free: int, max_bytes: int | None, suggestion: str = CLI_SUGGESTION
) -> str | None:
    """Why the capture must not start (one sentence), or None when it fits."""
    if max_bytes is not None and plan.expected_bytes > max_bytes:
        return (
            f"the capture would write {plan.describe()}, more than the limit of "
            f"{format_bytes(max_bytes)}; {suggestion}"
        )
    if plan.expected_bytes > free:
        return (
            f"the capture would write {plan.describe()}, but only {format_bytes(free)} "
            f"are free; {suggestion}"
        )
    return None
