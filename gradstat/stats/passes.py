"""Passes over a full gradient vector, shared by the threshold estimators.

Each pass runs in cache-sized chunks (abs, compare and compact in one go, temporaries
stay in L2/L3); sums are accumulated per chunk in float32 (torch's cascade summation)
and across chunks in float64.

:class:`RowPasses` answers every question the estimators ask of one row (its sums,
non-zeros and maximum from one pass; how many magnitudes exceed a threshold; which
ones) and keeps what it found for the next question: ``fit`` runs about 40 estimator
calls on each row, which scanned the row some 40 times; now the sums are one pass and a
count scans the smallest set of exceedances kept so far that holds the answer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from gradstat.errors import DataError
from gradstat.stats import row_kernels

_CHUNK = 1 << 20  # 4 MiB of float32: few parallel regions, temporaries stay in L2/L3
#: Elements per chunk of a numpy count or filter (1 MiB of float32, the mask 256 KiB).
_SCAN_CHUNK = 1 << 18
#: Exceedance sets a :class:`RowPasses` keeps, in elements, as a share of the row.
POOL_SHARE = 1.0


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
    for (lo, hi), count in zip(spans, counts, strict=True):
        np.compress(mask[lo:hi], values[lo:hi], out=out[at : at + count])
        at += count
    return torch.from_numpy(out)


def compress_in_place(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``x[keep]`` for a flat ``x`` the caller owns, written over its front and returned as
    a view of it (on a GPU, a new tensor): no second row. Chunk by chunk through a
    chunk-sized scratch; each chunk's kept values land at or before where they were, after
    the chunk is read. (Fit's split of a 32M-value row peaked 420 MB over the row with a
    compacted copy.)"""
    if x.device.type != "cpu":
        return x[keep]
    values, mask = x.numpy(), keep.numpy()
    scratch = np.empty(min(values.size, _SCAN_CHUNK), dtype=values.dtype)
    at = 0
    for lo in range(0, values.size, _SCAN_CHUNK):
        part = mask[lo : lo + _SCAN_CHUNK]
        kept = int(np.count_nonzero(part))
        np.compress(part, values[lo : lo + _SCAN_CHUNK], out=scratch[:kept])
        values[at : at + kept] = scratch[:kept]
        at += kept
    return x[:at]


def drop_zeros_in_place(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(``x`` without its exact zeros, how many there were) for a flat ``x`` the caller
    owns: :func:`compress_in_place` of ``x != 0`` (on a GPU, a new tensor)."""
    kept = compress_in_place(x, x != 0)
    return kept, x.numel() - kept.numel()


#: Rows (or pools) shorter than this are not scanned by the compiled loops: numba's start
#: (about 0.7 s once per process) would outweigh what they save (8M values: about 45 ms a
#: row of ``fit``), and a process that fits small captures never loads it.
COMPILED_MIN_NUMEL = 1 << 22


def _plain_row(values: torch.Tensor, min_numel: int = 0) -> np.ndarray | None:
    """The float32 values as numpy when the compiled loops can scan them (contiguous, on
    the CPU, at least ``min_numel`` of them), else None."""
    if (
        values.device.type == "cpu"
        and values.dtype == torch.float32
        and values.is_contiguous()
        and values.numel() >= min_numel
    ):
        return values.reshape(-1).numpy()
    return None


def nonzeros(values: torch.Tensor, compiled: bool = True) -> int:
    """Number of non-zero elements: of a long CPU row one compiled count (8M values:
    1.3 ms against 19 ms for the abs and minimum below and a count; ``compiled=False``:
    never); else a cheap minimum first (gradients rarely hold zeros)."""
    row = _plain_row(values, COMPILED_MIN_NUMEL) if compiled else None
    if row is not None:
        return row_kernels.count_nonzero(row)
    if values.numel() and float(values.abs().amin()) > 0:
        return values.numel()
    return int(torch.count_nonzero(values))


@dataclass(frozen=True)
class MagnitudeSums:
    """One pass of sums over a vector x: what SIDCo's first stage, Gaussian-k and
    RedSync need. ``signed_total`` sums x, ``total`` |x|, ``squares`` x^2, ``maximum``
    is max |x|; ``log_sum`` sums ln|x| over the non-zeros only (NaN unless asked for).
    """

    numel: int
    nonzeros: int
    total: float
    squares: float
    log_sum: float
    signed_total: float = math.nan
    maximum: float = math.nan


def _require_finite_sums(total: float, squares: float) -> None:
    """The check every way of taking a row's sums ends with: a NaN or Inf value makes
    its sums NaN or Inf, which is a :class:`DataError`."""
    if not (math.isfinite(total) and math.isfinite(squares)):
        raise DataError("the values contain NaN or Inf; drop them before estimating")


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
    _require_finite_sums(total, square_sum)
    signed_total = float(torch.stack(signed).double().sum())
    maximum = float(torch.stack(maxima).amax())
    log_sum = log_magnitude_sum(values, n) if log else math.nan
    return MagnitudeSums(numel, n, total, square_sum, log_sum, signed_total, maximum)


def row_sums(row: np.ndarray) -> MagnitudeSums:
    """:func:`magnitude_sums` (without the log sum) of a long float32 CPU row by the
    compiled loops: one pass, float64 sums (:func:`row_kernels.magnitude_sums`)."""
    signed, total, squares, maximum, zeros = row_kernels.magnitude_sums(row)
    _require_finite_sums(total, squares)
    return MagnitudeSums(row.size, row.size - zeros, total, squares, math.nan, signed, maximum)


def _wide_sums(values: torch.Tensor) -> tuple[float, float]:
    """(sum |x|, sum x^2) in float64, chunk by chunk (where float32 sums overflow)."""
    total = squares = 0.0
    for chunk in chunks(values):
        a = chunk.abs().double()
        total, squares = total + float(a.sum()), squares + float(torch.dot(a, a))
    return total, squares


def log_magnitude_sum(values: torch.Tensor, nonzeros: int) -> float:
    """Sum of ln|x| over the ``nonzeros`` non-zero values (a zero counts as ln 1 = 0; a
    pass of its own, for the gamma fits only). Regression: zeros were clamped to the
    smallest normal float, and so were subnormal values, which lost ln(2^-126 / |x|)."""
    logs = [torch.where(a == 0, 1.0, a).log().sum() for a in (c.abs() for c in chunks(values))]
    return float(torch.stack(logs).double().sum())


@dataclass(frozen=True)
class ExceedanceSums:
    """Count, float32 sum and sum of squares, and minimum of the magnitudes above a level
    (what a later SIDCo stage fits); ``minimum`` is NaN when none is."""

    n: int
    total: float
    squares: float
    minimum: float


def _pieces(a: np.ndarray) -> Iterator[np.ndarray]:
    """A flat numpy vector in views of at most ``_SCAN_CHUNK`` elements."""
    return (a[lo : lo + _SCAN_CHUNK] for lo in range(0, a.size, _SCAN_CHUNK))


def pool_sums(magnitudes: np.ndarray, signed: np.ndarray) -> MagnitudeSums:
    """:func:`magnitude_sums` (without the log sum) from the non-zero magnitudes a caller
    already has and the signed row for its signed sum: float32 pairwise sums per chunk
    (float64 for a chunk whose float32 sums overflow: values over 1.8e19), squares
    through a chunk-sized scratch, float64 across chunks; no row-sized temporary
    (32M values: 45 ms with :func:`pool_log_sum`, against 140-350 ms over the row's |x|)."""
    total = squares = maximum = 0.0
    scratch = np.empty(min(magnitudes.size, _SCAN_CHUNK), dtype=magnitudes.dtype)
    for part in _pieces(magnitudes):
        with np.errstate(over="ignore"):  # overflow: the float64 sums below
            chunk_total = float(np.add.reduce(part))
            chunk_squares = float(np.add.reduce(np.multiply(part, part, out=scratch[: part.size])))
        if math.isinf(chunk_total + chunk_squares) and np.isfinite(part).all():
            wide = part.astype(np.float64)
            chunk_total, chunk_squares = float(wide.sum()), float(np.dot(wide, wide))
        total, squares = total + chunk_total, squares + chunk_squares
        maximum = max(maximum, float(part.max()))
    _require_finite_sums(total, squares)
    signed_total = sum(float(np.add.reduce(part)) for part in _pieces(signed))
    n = magnitudes.size
    return MagnitudeSums(signed.size, n, total, squares, math.nan, signed_total, maximum)


def pool_log_sum(magnitudes: np.ndarray) -> float:
    """Sum of ln x over non-zero magnitudes (:func:`log_magnitude_sum` without the
    clamp): float32 logs into a chunk-sized scratch, pairwise sums per chunk."""
    scratch = np.empty(min(magnitudes.size, _SCAN_CHUNK), dtype=magnitudes.dtype)
    return sum(
        float(np.add.reduce(np.log(part, out=scratch[: part.size]))) for part in _pieces(magnitudes)
    )


def zeros_selected(threshold: float, inclusive: bool) -> bool:
    """Whether zeros pass ``|x| > threshold`` (``>=`` when inclusive) as float32 compares
    (the threshold rounded to float32: a positive one under half the smallest subnormal
    is 0), or the threshold is NaN: then sets of non-zero magnitudes cannot answer."""
    if math.isnan(threshold):
        return True
    with np.errstate(over="ignore"):  # a huge threshold is +inf in float32
        return threshold < 0 or (inclusive and np.float32(threshold) <= 0)


def _holds(pool: tuple[float, bool], threshold: float, inclusive: bool) -> bool:
    """Whether the set {|x| > floor} ({|x| >= floor} for an inclusive pool) holds every
    magnitude the query selects: {|x| >= t} needs t > floor (t >= floor for an
    inclusive pool), {|x| > t} needs t >= floor."""
    floor, pool_inclusive = pool
    return threshold > floor or (threshold == floor and (pool_inclusive or not inclusive))


class RowPasses:
    """The questions threshold estimators ask of one signed, finite row ``values``,
    each answered from as little of the row as possible and kept.

    * :meth:`sums` (:func:`magnitude_sums`, with the log sum on request): one pass;
    * :meth:`count` and :meth:`exceed` of ``|x| > t`` (``>=`` when inclusive): run over
      the smallest kept *pool* that holds the answer. The first pool is the non-zero
      magnitudes when the caller has them (e.g. ``fit``'s); without them a long CPU row
      is scanned itself by compiled loops (|x| compared in float32 as numpy compares, no
      row-sized |x|: 8M values 2.7-7.7 ms against 9.6-25 ms), elsewhere |x| is taken
      once. Every :meth:`exceed` result becomes a pool, and so does the set a count found
      when it is at most a quarter of the pool it scanned. Pools keep the row's order, so
      results equal those of a scan of ``values`` itself. Kept pools hold at most
      ``POOL_SHARE`` of the row (the least recently used go first).

    ``nonzeros``: the row's count of non-zero values, when the caller already has it.

    One instance per row; numpy's loops over pools on the CPU (a count of 8M values in
    2.5 ms, torch's chunked abs/compare/count in 8 ms), torch's elsewhere.
    """

    def __init__(
        self,
        values: torch.Tensor,
        magnitudes: torch.Tensor | None = None,
        *,
        compiled: bool = True,
        nonzeros: int | None = None,
    ) -> None:
        self.values = values.reshape(-1)
        self._magnitudes = magnitudes
        self._given = magnitudes is not None  # the sums come from them (not from |x|)
        self._sums: MagnitudeSums | None = None
        self._nonzeros = nonzeros  # given by a caller that counted them, else counted once
        self._pools: list[list] = []  # [floor, inclusive, exceedances, last use]
        self._uses = 0
        self._mask = np.empty(0, dtype=bool)
        self._exceedance_sums: dict[tuple[float, bool], ExceedanceSums] = {}
        #: whether the compiled loops scan the row and its pools (a long CPU float32 row,
        #: unless the caller keeps its process free of numba: ``compiled=False``)
        self._compiled = compiled and _plain_row(self.values, COMPILED_MIN_NUMEL) is not None

    @property
    def numel(self) -> int:
        return self.values.numel()

    def sums(self, log: bool = False) -> MagnitudeSums:
        """:func:`magnitude_sums` of the row (with the log sum when ``log``); from the
        caller's non-zero magnitudes when both are CPU float32 vectors (:func:`pool_sums`,
        :func:`pool_log_sum`), from the compiled loops over a long CPU row
        (:func:`row_sums`: a replay of SIDCo-P on 4 x 32M spent 1.5 of its 3.3 s in the
        chunked torch sums)."""
        plain = _plain_row(self._magnitudes) if self._given else None
        signed = _plain_row(self.values)
        pooled = plain is not None and signed is not None
        if self._sums is None and pooled:
            self._sums = pool_sums(plain, signed)
        elif self._sums is None and self._compiled:
            self._sums = row_sums(self.values.numpy())
        elif self._sums is None:
            self._sums = magnitude_sums(self.values, log=log)
        if log and math.isnan(self._sums.log_sum):  # only the log pass is missing
            if pooled:
                log_sum = pool_log_sum(plain)
            else:
                log_sum = log_magnitude_sum(self.values, self._sums.nonzeros)
            self._sums = replace(self._sums, log_sum=log_sum)
        return self._sums

    @property
    def nonzeros(self) -> int:
        """Non-zero elements: from the sums when they are in, else a cheap minimum first."""
        if self._sums is not None:
            return self._sums.nonzeros
        if self._nonzeros is None:
            self._nonzeros = nonzeros(self.values, self._compiled)
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
            return exceed(self.values, threshold, inclusive)
        for kept in self._pools:
            if kept[0] == threshold and kept[1] == inclusive:
                kept[3] = self._tick()
                return kept[2]
        found = self._scan(self._pool(threshold, inclusive), threshold, inclusive, keep=True)
        self._keep(threshold, inclusive, found)
        return found

    def kth_largest(self, k: int, at_least: float) -> float:
        """The k-th largest |x|, where at least k of them are >= ``at_least`` (the top k
        of that set: ``torch.topk``)."""
        candidates = self.exceed(at_least, inclusive=True)
        return float(torch.topk(candidates, k, sorted=False).values.amin())

    def exceedance_sums(self, threshold: float, inclusive: bool = False) -> ExceedanceSums:
        """Sums of :meth:`exceed`'s set, kept per level: ``fit`` runs each SIDCo variant at
        every ratio and stage count, and all runs of more than one stage fit the same
        exceedances of stage 1 (8M values: 9 sums of a 2M-value set a row became 3)."""
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
        itself, a CPU row whose magnitudes were not given (see the class docstring)."""
        best, chosen = self._magnitudes, None
        if best is None and not self._compiled:
            best = self.magnitudes()
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
        (pool None: the row's |x|); float32 on the CPU by the compiled loops (a pool of
        8M: 1.1 ms a count, 2.7-7.7 ms a compaction, against 3.6-10 ms for numpy's
        compare and compress), else numpy's or torch's."""
        row = _plain_row(self.values if pool is None else pool) if self._compiled else None
        if row is not None:  # the row's |x| or a pool of them: compiled passes
            if keep:
                return torch.from_numpy(row_kernels.magnitudes_at_least(row, threshold, inclusive))
            return row_kernels.count_at_least(row, threshold, inclusive)
        assert pool is not None
        if pool.device.type != "cpu":
            mask = pool >= threshold if inclusive else pool > threshold
            return pool[mask] if keep else int(torch.count_nonzero(mask))
        limit = row_kernels.float32_limit(threshold, inclusive)  # as the compiled loops
        if self._mask.size < min(pool.numel(), _SCAN_CHUNK):
            self._mask = np.empty(min(pool.numel(), _SCAN_CHUNK), dtype=bool)
        a, total, parts = pool.numpy(), 0, []
        for lo in range(0, a.size, _SCAN_CHUNK):
            part = a[lo : lo + _SCAN_CHUNK]
            mask = self._mask[: part.size]
            np.greater_equal(part, limit, out=mask)
            if keep:
                parts.append(np.compress(mask, part))  # boolean indexing: 3x slower
            else:
                total += np.count_nonzero(mask)
        if not keep:
            return int(total)
        return torch.from_numpy(np.concatenate(parts) if parts else a[:0].copy())
