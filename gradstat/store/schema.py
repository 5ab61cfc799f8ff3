"""Names and constants of the HDF5 capture format, schema 2 (see docs/format.md).

A capture is a folder: ``capture.h5`` (metadata, layer table, virtual datasets) and one
``rank-NNNNN.h5`` per learner, each written only by that learner.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 2
#: Schemas this gradstat reads: 1 has no per-row checksums (rows verified by size only).
READABLE_SCHEMAS = (1, 2)
FORMAT_NAME = "gradstat-capture"
ROOT_FILE = "capture.h5"
#: Largest chunk of one /grad row, in bytes (DESIGN.md: one row by <= 1 MiB).
MAX_CHUNK_BYTES = 1 << 20
SUPPORTED_DTYPES = ("float32", "float16")


def rank_file_name(rank: int) -> str:
    """File name of one learner's gradients, e.g. ``rank-00003.h5``."""
    return f"rank-{rank:05d}.h5"


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
