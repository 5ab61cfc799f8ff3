"""Names and constants of the HDF5 capture format, schema 2 (see docs/format.md).

A capture is a folder: ``capture.h5`` (metadata, layer table, virtual datasets) and one
``rank-NNNNN.h5`` per learner, each written only by that learner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

SCHEMA_VERSION = 2
#: Schemas this gradstat reads: 1 has no per-row checksums (rows verified by size only).
READABLE_SCHEMAS = (1, 2)
FORMAT_NAME = "gradstat-capture"
ROOT_FILE = "capture.h5"
#: Largest chunk of one /grad row, in bytes (docs/format.md: one row by <= 1 MiB).
MAX_CHUNK_BYTES = 1 << 20
#: Storage types of /grad rows (gradstat/store/dtypes.py maps them to HDF5 types).
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
#: Root attribute listing the ranks that wrote a rank file (all of them when absent).
RECORDED_RANKS_ATTR = "recorded_ranks"


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
