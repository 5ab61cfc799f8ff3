"""FSDP2's reduce-scatter layout of a flat message: which values each learner's shard
holds, and back (docs/capture.md, "FSDP").

FSDP lays a unit's gradients out as the ``(world_size, -1)`` ``chunk_cat`` of its
parameters, in the unit's order: each gradient padded on dim 0 to a multiple of
``world_size`` and cut into ``world_size`` chunks (a gradient sharded on dim k > 0 is
cut on dim k and the pieces stacked on dim 0, no padding); learner r's shard is row r.
A parameter here is anything with ``shape``, ``shard_dim`` and ``offset`` (its first
value in the flat vector): the capture's ``ParamSlot`` (gradstat/capture/fsdp.py) and
the replay's pieces of a message (:func:`pieces`). The capture and the replay of HSDP's
replicate stage (gradstat/analysis/replay_block.py) share these functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Piece:
    """One parameter of a flat message: its shape, the dim FSDP shards it on, and its
    first value in the message."""

    shape: tuple[int, ...]
    shard_dim: int
    offset: int


def pieces(shapes: Sequence[tuple[int, ...]]) -> list[Piece]:
    """The parameters of a message of ``shapes`` laid end to end, sharded on dim 0 (as
    ``fully_shard`` shards by default)."""
    out, offset = [], 0
    for shape in shapes:
        out.append(Piece(tuple(shape), 0, offset))
        offset += math.prod(shape)
    return out


def chunk(shape: tuple[int, ...], shard_dim: int, world_size: int) -> int:
    """Values of a parameter of ``shape`` in one row of the ``(world_size, -1)`` layout."""
    if shard_dim == 0:
        rows = -(-shape[0] // world_size) if shape else 1
        return rows * math.prod(shape[1:])
    return math.prod(shape) // world_size


def shard_numel(params: Sequence[Any], world_size: int) -> int:
    """Values of one learner's shard (padding included)."""
    return sum(chunk(p.shape, p.shard_dim, world_size) for p in params)


def shard_of(params: Sequence[Any], row: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Learner ``rank``'s row of the layout of the values of ``params`` in ``row`` (the
    flat vector, by their offsets): what a reduce-scatter of it leaves on ``rank``,
    zeros in the padding; the inverse of :func:`unshard`."""
    out = []
    for p in params:
        size, numel = chunk(p.shape, p.shard_dim, world_size), math.prod(p.shape)
        values = row[p.offset : p.offset + numel]
        if p.shard_dim == 0:
            piece = values[rank * size : (rank + 1) * size]
            out += [piece, torch.zeros(size - piece.numel(), dtype=row.dtype)]
        else:
            k = p.shard_dim
            split = values.view(p.shape).unflatten(k, (world_size, -1))
            out.append(split.select(k, rank).reshape(-1))
    return torch.cat(out)


def _unchunk(
    param: Any, block: torch.Tensor, dest: torch.Tensor, world_size: int, non_blocking: bool
) -> None:
    """One parameter's ``(world_size, chunk)`` columns of the layout into its flat
    slice ``dest`` (the padding dropped)."""
    size, shape = block.shape[1], param.shape
    if param.shard_dim == 0:  # the padded gradient, row after row
        full, rest = divmod(math.prod(shape), size) if size else (0, 0)
        if full:
            dest[: full * size].view(full, size).copy_(block[:full], non_blocking=non_blocking)
        if rest:
            dest[full * size :].copy_(block[full, :rest], non_blocking=non_blocking)
    else:  # world_size pieces of dim k, stacked on dim 0
        k = param.shard_dim
        piece = (*shape[:k], shape[k] // world_size, *shape[k + 1 :])
        source = block.reshape(world_size, *piece).movedim(0, k)
        target = dest.view(shape).unflatten(k, (world_size, shape[k] // world_size))
        target.copy_(source, non_blocking=non_blocking)


def unshard(
    params: Sequence[Any], shards: torch.Tensor, row: torch.Tensor, non_blocking: bool = False
) -> None:
    """Every learner's shard (``shards``: ``(world_size, shard_numel)``, rank order)
    back into ``row`` at the parameters' offsets (a parameter whose ``offset`` is None
    keeps its columns but goes nowhere): the inverse of :func:`shard_of`."""
    world_size, column = shards.shape[0], 0
    for p in params:
        size = chunk(p.shape, p.shard_dim, world_size)
        if p.offset is not None:
            dest = row[p.offset : p.offset + math.prod(p.shape)]
            _unchunk(p, shards[:, column : column + size], dest, world_size, non_blocking)
        column += size
