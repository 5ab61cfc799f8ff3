"""Chunked passes over a full gradient vector, shared by the threshold estimators.

Each pass runs in cache-sized chunks (abs, compare and compact in one go, temporaries
stay in L2/L3); sums are accumulated per chunk in float32 (torch's cascade summation)
and across chunks in float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradstat.errors import DataError

_CHUNK = 1 << 20  # 4 MiB of float32: few parallel regions, temporaries stay in L2/L3
_TINY = torch.finfo(torch.float32).tiny


def chunks(values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The flat vector in views of at most 1M elements."""
    return values.reshape(-1).split(_CHUNK)


def exceed(values: torch.Tensor, threshold: float, inclusive: bool = False) -> torch.Tensor:
    """The magnitudes above ``threshold`` (``>=`` when ``inclusive``), compacted."""
    parts = []
    for chunk in chunks(values):
        a = chunk.abs()
        parts.append(a[a >= threshold] if inclusive else a[a > threshold])
    return torch.cat(parts)


def count(values: torch.Tensor, threshold: float, inclusive: bool = False) -> int:
    """How many magnitudes exceed ``threshold`` (``>=`` when ``inclusive``)."""
    counts = [
        torch.count_nonzero(a >= threshold if inclusive else a > threshold)
        for a in (chunk.abs() for chunk in chunks(values))
    ]
    return int(torch.stack(counts).sum())


def nonzeros(values: torch.Tensor) -> int:
    """Number of non-zero elements (a cheap minimum first: gradients rarely hold zeros)."""
    if values.numel() and float(values.abs().amin()) > 0:
        return values.numel()
    return int(torch.count_nonzero(values))


@dataclass(frozen=True)
class MagnitudeSums:
    """One pass of sums over |values|: what every SIDCo first stage needs.

    ``log_sum`` sums ln|x| over the non-zeros only (NaN unless asked for).
    """

    numel: int
    nonzeros: int
    total: float
    squares: float
    log_sum: float


def magnitude_sums(values: torch.Tensor, *, log: bool = False) -> MagnitudeSums:
    """Sums of |x|, x^2 and (optionally) ln|x| over the non-zeros, and the counts.

    The log sum skips zeros by clamping them to the smallest normal float and removing
    their contribution. Raises :class:`DataError` on NaN or Inf.
    """
    sums, squares, logs, counts = [], [], [], []
    for chunk in chunks(values):
        a = chunk.abs()
        sums.append(a.sum())
        squares.append(a.square().sum())
        if log:
            logs.append(a.clamp_min(_TINY).log().sum())
        counts.append(torch.count_nonzero(a))
    numel = values.numel()
    n = int(torch.stack(counts).sum())
    total = float(torch.stack(sums).double().sum())
    square_sum = float(torch.stack(squares).double().sum())
    if not (math.isfinite(total) and math.isfinite(square_sum)):
        raise DataError("the values contain NaN or Inf; drop them before estimating")
    log_sum = math.nan
    if log:
        log_sum = float(torch.stack(logs).double().sum()) - (numel - n) * math.log(_TINY)
    return MagnitudeSums(numel, n, total, square_sum, log_sum)
