"""The exact row statistics: :class:`RowPasses`, passes over the row's own values.

Each pass over a whole row runs in cache-sized chunks (abs, compare and compact in one
go); sums are accumulated per chunk in float32 (torch's cascade summation) and across
chunks in float64, or in float64 throughout by the compiled loops of a long CPU row.

:class:`RowPasses` answers what the threshold estimators ask of one row
(:class:`~gradstat.stats.row_statistics.RowStatistics`) and keeps what it found for the
next question: a replay runs several estimators on a row, and ``fit`` about 40, each
asking for sums and counts; the sums are one pass, and a count scans the smallest set of
exceedances kept so far that holds the answer.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from gradstat.stats import row_kernels
from gradstat.stats.row_statistics import (
    ExceedanceSums,
    MagnitudeSums,
    require_finite_sums,
    zeros_selected,
)
from gradstat.stats.topk_sets import prefilter_threshold

_CHUNK = 1 << 20  # 4 MiB of float32: few parallel regions, temporaries stay in L2/L3
#: Elements per chunk of a numpy compaction (1 MiB of float32, the mask 256 KiB).
_SCAN_CHUNK = 1 << 18
#: Exceedance sets a :class:`RowPasses` keeps, in elements, as a share of the row.
POOL_SHARE = 1.0
#: Rows shorter than this are not scanned by the compiled loops unless asked: numba's
#: start (about 0.7 s once per process) would outweigh what they save (8M values: about
#: 45 ms a row of ``fit``), and a process that handles small rows never loads it.
COMPILED_MIN_NUMEL = 1 << 22


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


def compress(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x[keep]`` for flat ``x``; on the CPU numpy's compress, chunk by chunk into one
    output. (torch's boolean indexing of a dense mask took 0.4 s for 32M values, numpy
    0.05 s; numpy's compress of a whole row builds an int64 index of the kept
    positions, twice the row's float32 bytes, where a chunk's takes 2 MiB.)"""
    if x.device.type != "cpu":
        return x[keep]
    values, mask = x.numpy(), keep.numpy()
    spans = [(lo, lo + _SCAN_CHUNK) for lo in range(0, values.size, _SCAN_CHUNK)]
    counts = [int(np.count_nonzero(mask[lo:hi])) for lo, hi in spans]
    out = np.empty(sum(counts), dtype=values.dtype)
    at = 0
    for (lo, hi), kept in zip(spans, counts, strict=True):
        np.compress(mask[lo:hi], values[lo:hi], out=out[at : at + kept])
        at += kept
    return torch.from_numpy(out)


def plain_row(values: torch.Tensor) -> np.ndarray | None:
    """The values as a flat numpy row when the compiled loops can scan them (float32,
    contiguous, on the CPU), else None."""
    if values.device.type == "cpu" and values.dtype == torch.float32 and values.is_contiguous():
        return values.reshape(-1).numpy()
    return None


def magnitude_sums(values: torch.Tensor, *, log: bool = False) -> MagnitudeSums:
    """Sums of x, |x|, x^2 and (optionally) ln|x| over the non-zeros, max |x| and the
    counts, in one pass. Raises :class:`DataError` on NaN or Inf."""
    signed, sums, squares, counts, maxima = [], [], [], [], []
    for chunk in chunks(values):
        signed.append(chunk.sum())
        a = chunk.abs()
        sums.append(a.sum())
        squares.append(a.square().sum())
        maxima.append(a.amax())
        counts.append(torch.count_nonzero(a))
    numel = values.numel()
    n = int(torch.stack(counts).sum())
    total = float(torch.stack(sums).double().sum())
    square_sum = float(torch.stack(squares).double().sum())
    if math.isinf(total + square_sum) and bool(torch.isfinite(values).all()):
        total, square_sum = _wide_sums(values)  # float32 overflowed: values over 1.8e19
    require_finite_sums(total, square_sum)
    signed_total = float(torch.stack(signed).double().sum())
    maximum = float(torch.stack(maxima).amax())
    log_sum = log_magnitude_sum(values) if log else math.nan
    return MagnitudeSums(numel, n, total, square_sum, log_sum, signed_total, maximum)


def row_sums(row: np.ndarray) -> MagnitudeSums:
    """:func:`magnitude_sums` (without the log sum) of a float32 CPU row by the compiled
    loops: one pass, float64 sums (:func:`row_kernels.magnitude_sums`)."""
    signed, total, squares, maximum, zeros = row_kernels.magnitude_sums(row)
    require_finite_sums(total, squares)
    return MagnitudeSums(row.size, row.size - zeros, total, squares, math.nan, signed, maximum)


def _wide_sums(values: torch.Tensor) -> tuple[float, float]:
    """(sum |x|, sum x^2) in float64, chunk by chunk (where float32 sums overflow)."""
    total = squares = 0.0
    for chunk in chunks(values):
        a = chunk.abs().double()
        total, squares = total + float(a.sum()), squares + float(torch.dot(a, a))
    return total, squares


def log_magnitude_sum(values: torch.Tensor) -> float:
    """Sum of ln|x| over the non-zero values (a zero counts as ln 1 = 0; a pass of its
    own, for the gamma fits only). Regression: zeros were clamped to the smallest normal
    float, and so were subnormal values, which lost ln(2^-126 / |x|)."""
    logs = [torch.where(a == 0, 1.0, a).log().sum() for a in (c.abs() for c in chunks(values))]
    return float(torch.stack(logs).double().sum())


def _holds(pool: tuple[float, bool], threshold: float, inclusive: bool) -> bool:
    """Whether the set {|x| > floor} ({|x| >= floor} for an inclusive pool) holds every
    magnitude the query selects: {|x| >= t} needs t > floor (t >= floor for an
    inclusive pool), {|x| > t} needs t >= floor."""
    floor, pool_inclusive = pool
    return threshold > floor or (threshold == floor and (pool_inclusive or not inclusive))


class RowPasses:
    """The exact :class:`~gradstat.stats.row_statistics.RowStatistics` of one signed,
    finite row ``values``, each answer from as little of the row as possible, and kept.

    * :meth:`sums`: one pass (with the log sum on request, a second);
    * :meth:`count` and :meth:`exceed`: over the smallest kept *pool* that holds the
      answer. The compiled loops scan a CPU float32 row itself (|x| compared in float32
      as numpy compares, no row-sized |x|: 8M values 2.7-7.7 ms against 9.6-25 ms);
      otherwise the first pool is the row's non-zero |x|, taken once. Every
      :meth:`exceed` result becomes a pool, and so does the set a count found when it
      is at most a quarter of the pool it scanned. Pools keep the row's order, so
      results equal those of a scan of ``values`` itself. Kept pools hold at most
      ``POOL_SHARE`` of the row (the least recently used go first).
    * :meth:`kth_largest`: the top k of the pool above a level at least k values reach.

    ``compiled``: whether the compiled loops scan the row and its pools (None: a CPU
    float32 row of ``COMPILED_MIN_NUMEL`` values or more); ``nonzeros``: the row's count
    of non-zero values, when the caller already has it. :attr:`scans` counts the passes
    over the whole row.
    """

    def __init__(
        self, values: torch.Tensor, *, compiled: bool | None = None, nonzeros: int | None = None
    ) -> None:
        self.values = values.reshape(-1)
        row = plain_row(self.values)
        if compiled is None:
            compiled = row is not None and row.size >= COMPILED_MIN_NUMEL
        self._row = row if compiled else None
        self._magnitudes: torch.Tensor | None = None
        self._sums: MagnitudeSums | None = None
        self._nonzeros = nonzeros
        self._pools: list[list] = []  # [floor, inclusive, exceedances, last use]
        self._uses = 0
        self._exceedance_sums: dict[tuple[float, bool], ExceedanceSums] = {}
        self.scans = 0

    @property
    def numel(self) -> int:
        return self.values.numel()

    def sums(self, log: bool = False) -> MagnitudeSums:
        """:func:`magnitude_sums` of the row (with the log sum when ``log``), by the
        compiled loops where they scan the row (:func:`row_sums`: a replay of SIDCo-P
        on 4 x 32M spent 1.5 of its 3.3 s in the chunked torch sums)."""
        if self._sums is None:
            self.scans += 1
            if self._row is not None:
                self._sums = row_sums(self._row)
            else:
                self._sums = magnitude_sums(self.values, log=log)
        if log and math.isnan(self._sums.log_sum):  # only the log pass is missing
            self.scans += 1
            self._sums = replace(self._sums, log_sum=log_magnitude_sum(self.values))
        return self._sums

    @property
    def nonzeros(self) -> int:
        """Non-zero elements: from the sums when they are in, else counted once (by the
        compiled loops: 8M values in 1.3 ms; else a cheap minimum first, gradients
        rarely hold zeros)."""
        if self._sums is not None:
            return self._sums.nonzeros
        if self._nonzeros is None:
            self.scans += 1
            if self._row is not None:
                self._nonzeros = row_kernels.count_nonzero(self._row)
            elif self.numel and float(self.values.abs().amin()) > 0:
                self._nonzeros = self.numel
            else:
                self._nonzeros = int(torch.count_nonzero(self.values))
        return self._nonzeros

    def magnitudes(self) -> torch.Tensor:
        """The non-zero |x| in the row's order (the first pool)."""
        if self._magnitudes is None:
            a = self.values.abs()
            self._magnitudes = a if self.nonzeros == a.numel() else compress(a, a != 0)
        return self._magnitudes

    def count(self, threshold: float, inclusive: bool = False) -> int:
        """How many |x| exceed ``threshold`` (``>=`` when ``inclusive``)."""
        if zeros_selected(threshold, inclusive):
            self.scans += 1
            return count(self.values, threshold, inclusive)
        pool = self._pool(threshold, inclusive)
        found = self._scan(pool, threshold, inclusive, keep=False)
        size = self.numel if pool is None else pool.numel()
        if 4 * found <= size and found:  # worth keeping for the counts to come
            self._keep(threshold, inclusive, self._scan(pool, threshold, inclusive, keep=True))
        return found

    def exceed(self, threshold: float, inclusive: bool = False) -> torch.Tensor:
        """The |x| above ``threshold`` (``>=`` when ``inclusive``), in the row's order."""
        if zeros_selected(threshold, inclusive):
            self.scans += 1
            return exceed(self.values, threshold, inclusive)
        for kept in self._pools:
            if kept[0] == threshold and kept[1] == inclusive:
                kept[3] = self._tick()
                return kept[2]
        found = self._scan(self._pool(threshold, inclusive), threshold, inclusive, keep=True)
        self._keep(threshold, inclusive, found)
        return found

    def kth_largest(self, k: int, at_least: float | None = None) -> float:
        """The k-th largest |x| (1 <= k <= nonzeros): the top k of the |x| >= ``at_least``,
        a level at least k of them reach. Without one, a long row's level is top-k's
        pre-filter threshold (:func:`~gradstat.stats.topk_sets.prefilter_threshold`, an
        upper quantile of a strided sample that about 1.5 k pass; when fewer than k do,
        or a short or dense row has none, every non-zero |x|)."""
        if at_least is None:
            at_least = prefilter_threshold(self.values, k) or 0.0
        candidates = self.exceed(at_least, inclusive=True) if at_least > 0 else None
        if candidates is None or candidates.numel() < k:
            candidates = self.magnitudes()
        return float(torch.topk(candidates, k, sorted=False).values.amin())

    def exceedance_sums(self, threshold: float, inclusive: bool = False) -> ExceedanceSums:
        """Sums of :meth:`exceed`'s set (float32 sums, float64 across chunks), kept per
        level: ``fit`` runs each SIDCo variant at every ratio and stage count, and all
        runs of more than one stage fit the same exceedances of stage 1 (8M values: 9
        sums of a 2M-value set a row became 3)."""
        key = (threshold, inclusive)
        if key not in self._exceedance_sums:
            above = self.exceed(threshold, inclusive)
            n = above.numel()
            minimum = float(above.amin()) if n else math.nan
            total, squares = float(above.sum()), float(above.square().sum())
            if math.isinf(total + squares) and bool(torch.isfinite(above).all()):
                total, squares = _wide_sums(above)  # float32 overflowed: values over 1.8e19
            self._exceedance_sums[key] = ExceedanceSums(n, total, squares, minimum)
        return self._exceedance_sums[key]

    def _pool(self, threshold: float, inclusive: bool) -> torch.Tensor | None:
        """The smallest kept set that holds every |x| the query selects; None: the row
        itself, which the compiled loops scan (see the class docstring)."""
        best = None if self._row is not None else self.magnitudes()
        chosen = None
        for kept in self._pools:
            smaller = best is None or kept[2].numel() < best.numel()
            if smaller and _holds((kept[0], kept[1]), threshold, inclusive):
                best, chosen = kept[2], kept
        if chosen is not None:
            chosen[3] = self._tick()
        return best

    def _tick(self) -> int:
        self._uses += 1
        return self._uses

    def _keep(self, threshold: float, inclusive: bool, found: torch.Tensor) -> None:
        """Keep ``found`` as a pool; the least recently used go while over budget."""
        self._pools.append([threshold, inclusive, found, self._tick()])
        self._pools.sort(key=lambda kept: kept[3], reverse=True)
        while sum(kept[2].numel() for kept in self._pools) > POOL_SHARE * self.numel:
            self._pools.pop()

    def _scan(self, pool: torch.Tensor | None, threshold: float, inclusive: bool, keep: bool):
        """Count (``keep=False``) or compact (``keep=True``) the pool's elements that pass
        (pool None: the row's |x|): by the compiled loops where they scan the row (a
        pool of 8M: 1.1 ms a count, 2.7-7.7 ms a compaction, against 3.6-10 ms for
        numpy's compare and compress), else torch's compare (in the pool's dtype)."""
        if pool is None or self._row is not None:
            row = self._row if pool is None else plain_row(pool)
            if pool is None:
                self.scans += 1
            if row is not None:
                if keep:
                    found = row_kernels.magnitudes_at_least(row, threshold, inclusive)
                    return torch.from_numpy(found)
                return row_kernels.count_at_least(row, threshold, inclusive)
        passing = pool >= threshold if inclusive else pool > threshold
        return compress(pool, passing) if keep else int(torch.count_nonzero(passing))
