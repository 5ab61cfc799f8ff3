"""Names and constants of the HDF5 capture format, schema 3 (see docs/format.md).

A capture is a folder: ``capture.h5`` (metadata, layer table, virtual datasets) and one
``rank-NNNNN.h5`` per learner, each written only by that learner.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

SCHEMA_VERSION = 3
#: Schemas this gradstat reads: 1 has no checksums (rows verified by size only), 2 has
#: one CRC-32C per /grad row only; both open with a warning naming what is unchecked.
READABLE_SCHEMAS = (1, 2, 3)
FORMAT_NAME = "gradstat-capture"
ROOT_FILE = "capture.h5"
#: Largest chunk of one /grad row, in bytes (docs/format.md: one row by <= 1 MiB).
MAX_CHUNK_BYTES = 1 << 20
#: Storage types of /grad rows (gradstat/store/dtypes.py maps them to HDF5 types).
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
#: Root attribute listing the ranks that wrote a rank file (all of them when absent).
RECORDED_RANKS_ATTR = "recorded_ranks"
#: Root and rank-file attribute: the capture's identity, written by the root at creation.
RUN_ID_ATTR = "run_id"
#: Root attribute: CRC-32C of the capture's identity and layer table (schema 3).
CHECKSUM_ATTR = "checksum"
#: Root attribute: the per-learner batch size of the run (optional; docs/format.md).
BATCH_SIZE_ATTR = "batch_size"
#: Schema 3: CRC-32C of each block of ``columns`` values of each /grad and /sent row.
GRAD_CRC = "grad_crc32c"
SENT_CRC = "sent_crc32c"
#: Schema 3: CRC-32C of each row's bookkeeping (its /step, /loss and /sent_bytes).
RECORD_CRC = "record_crc32c"
#: Schema 2: CRC-32C of each whole /grad row.
ROW_CRC = "crc32c"
#: Attribute of a block checksum dataset: the values each checksum covers.
BLOCK_ATTR = "columns"
#: Bounds a capture's metadata is checked against before anything is sized by it: the
#: run's learners (``world_size``) and the values of one row (4 TiB of float32).
MAX_LEARNERS = 1 << 24
MAX_NUMEL = 1 << 40


def new_run_id() -> str:
    """A new capture identity: 32 hex digits (a random UUID)."""
    return uuid.uuid4().hex


def rank_file_name(rank: int) -> str:
    """File name of one learner's gradients, e.g. ``rank-00003.h5``."""
    return f"rank-{rank:05d}.h5"


def recorded_ranks(root_attrs: Mapping) -> list[int]:
    """The ranks that wrote a rank file, from ``capture.h5``'s attributes."""
    if RECORDED_RANKS_ATTR in root_attrs:
        return [int(r) for r in np.atleast_1d(root_attrs[RECORDED_RANKS_ATTR])]
    return list(range(int(root_attrs["world_size"])))


@dataclass(frozen=True)
class Layer:
    """One parameter's slice ``[offset, offset + numel)`` of the flat gradient vector."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]

    @property
    def stop(self) -> int:
        return self.offset + self.numel


def layer_table(named_shapes: list[tuple[str, tuple[int, ...]]]) -> list[Layer]:
    """Lay parameters end to end in the given order; returns the layer table."""
    layers, offset = [], 0
    for name, shape in named_shapes:
        numel = 1
        for size in shape:
            numel *= int(size)
        layers.append(Layer(name, offset, numel, tuple(int(s) for s in shape)))
        offset += numel
    return layers
