"""One pass per row for every count, sum, quantile and goodness-of-fit question of ``fit``
(the design and its measurements: docs/large.md, "Fit from one histogram per row").

Non-negative float32 values order as their bit patterns do as integers, so the bins
``bits(|x|) >> SHIFT`` (2^8 bins an octave) are intervals of |x| in ascending order. One
pass (``bin_sums_*``) takes each bin's count, float64 sum and sum of squares, and the
row's zeros, signed sum and maximum; a gather (one more pass) reads the values of only
the bins asked for (:meth:`RowHistogram.prefetch`; ``gathers`` counts the passes). A
count at any threshold is then exact: the counts above its bin plus a count over that
bin's values. A :meth:`RowHistogram.sketch` answers from the bins alone and notes the
bins it read: those the exact answers will read (``gradstat.analysis.fit``). The
compiled pass sums integers (``low + ulp m`` per value, ``m`` the low ``SHIFT`` bits),
each bin's sums rounded once to float64.

:class:`RowHistogram` is the binned :class:`~gradstat.stats.row_statistics.RowStatistics`
and answers what a distribution fit needs besides (:mod:`gradstat.stats.histogram_fit`).
Three builds of the bins and of a gather, the same numbers: numpy (``*_numpy``: the
plain references), numba (``*_compiled``, :mod:`gradstat.stats._histogram_loops`; CPU
rows of ``COMPILED_MIN_NUMEL`` or more) and torch (``*_torch``: ``torch.bincount`` and a
stable sort of the bit patterns on any device, e.g. ``--device cuda``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

import numpy as np
import torch

from gradstat.stats import passes, row_kernels
from gradstat.stats.row_kernels import float32_limit
from gradstat.stats.row_statistics import (
    ExceedanceSums,
    MagnitudeSums,
    require_finite_sums,
    zeros_selected,
)

#: Bits below the bin index: 23 - 15 = 8 mantissa bits in the bin, 2^8 bins an octave.
SHIFT = 15
#: Bins of non-negative finite float32 values, and one more for +inf (thresholds).
NBINS = (0x7F800000 >> SHIFT) + 1
#: Rows from this size gather only the bins asked for; shorter: every bin at once.
PLAN_MIN_NUMEL = 1 << 21
#: Bins either side of each bin a sketch read that a planned gather reads too.
MARGIN = 1
#: Bit patterns below this are subnormal.
NORMAL_BITS = 0x00800000
#: Signed bin j + SIGN_BIN holds the negative values of bin j (the compiled pass).
SIGN_BIN = 1 << (31 - SHIFT)
_CHUNK = 1 << 18
#: The compiled loops start (numba's import, about 0.7 s once a process) from this size.
COMPILED_MIN_NUMEL = passes.COMPILED_MIN_NUMEL


@dataclass(frozen=True)
class BinSums:
    """Per bin: ``counts`` (int64), float64 ``sums`` and ``squares`` of |x| (``NBINS``
    each; zeros and NaN/Inf in none); the row's ``zeros`` (+0 and -0), ``nonfinite``
    (NaN, +-Inf), float64 ``signed_total`` of the finite values, the largest bit pattern
    ``top_bits`` of a finite |x| (0 when all are zero)."""

    counts: np.ndarray
    sums: np.ndarray
    squares: np.ndarray
    zeros: int
    nonfinite: int
    signed_total: float
    top_bits: int


def bin_sums_numpy(row: np.ndarray) -> BinSums:
    """The plain reference: chunk by chunk, ``np.bincount`` of the bit patterns."""
    counts, sums, squares = np.zeros(NBINS, np.int64), np.zeros(NBINS), np.zeros(NBINS)
    zeros, nonfinite, signed, top = 0, 0, 0.0, 0
    for lo in range(0, row.size, _CHUNK):
        part = row[lo : lo + _CHUNK]
        finite = np.isfinite(part)
        if not finite.all():
            nonfinite += int(part.size - np.count_nonzero(finite))
            part = part[finite]
        a = np.abs(part).astype(np.float64)
        bits = np.abs(part).view(np.uint32)
        index = (bits >> SHIFT).astype(np.intp)
        counts += np.bincount(index, minlength=NBINS)
        sums += np.bincount(index, weights=a, minlength=NBINS)
        squares += np.bincount(index, weights=a * a, minlength=NBINS)
        zero = int(np.count_nonzero(bits == 0))
        zeros += zero
        counts[0] -= zero
        signed += float(np.sum(part, dtype=np.float64))
        top = max(top, int(bits.max(initial=0)))
    return BinSums(counts, sums, squares, zeros, nonfinite, signed, top)


def bin_sums_torch(values: torch.Tensor) -> BinSums:
    """``torch.bincount`` of the bit patterns on the values' device (float64 weights)."""
    counts, sums, squares = np.zeros(NBINS, np.int64), np.zeros(NBINS), np.zeros(NBINS)
    zeros, nonfinite, signed, top = 0, 0, 0.0, 0
    for part in values.reshape(-1).split(1 << 22):
        finite = torch.isfinite(part)
        if not bool(finite.all()):
            nonfinite += part.numel() - int(torch.count_nonzero(finite))
            part = part[finite]
        a = part.abs()
        bits = a.view(torch.int32)
        index = (bits >> SHIFT).long()
        wide = a.double()
        counts += torch.bincount(index, minlength=NBINS).cpu().numpy()
        sums += torch.bincount(index, weights=wide, minlength=NBINS).cpu().numpy()
        squares += torch.bincount(index, weights=wide * wide, minlength=NBINS).cpu().numpy()
        zero = int(torch.count_nonzero(bits == 0))
        zeros += zero
        counts[0] -= zero
        signed += float(part.double().sum())
        top = max(top, int(bits.max()) if bits.numel() else 0)
    return BinSums(counts, sums, squares, zeros, nonfinite, signed, top)


def bin_sums_compiled(row: np.ndarray) -> BinSums:
    """The numba pass (see the module): the counts equal :func:`bin_sums_numpy`'s, the
    sums are closer to the exact ones. It bins the signed bit patterns (the sign the top
    bit of the index): the signed sum is the positive bins' less the negative bins'."""
    counts = np.zeros(2 * SIGN_BIN, np.int64)
    mantissas, squares = np.zeros_like(counts), np.zeros_like(counts)
    zeros, top, loops = 0, 0, _loops()
    for lo in range(0, row.size, loops.MAX_VALUES):
        part = row[lo : lo + loops.MAX_VALUES]
        z, t = loops.bin_sums(part, SHIFT, counts, mantissas, squares)
        zeros, top = zeros + z, max(top, t)
    finite = NBINS - 1  # signed bins from here on hold NaN and +-Inf
    nonfinite = int(counts[finite:SIGN_BIN].sum() + counts[SIGN_BIN + finite :].sum())
    if nonfinite:
        top = np.abs(row[np.isfinite(row)]).view(np.uint32).max(initial=0)
    sums, sq = _float_sums(counts, mantissas, squares)
    positive, negative = slice(0, finite), slice(SIGN_BIN, SIGN_BIN + finite)
    both = np.zeros(NBINS, np.int64)
    both[:finite] = counts[positive] + counts[negative]
    both[0] -= zeros
    return BinSums(
        both,
        np.r_[sums[positive] + sums[negative], 0.0],
        np.r_[sq[positive] + sq[negative], 0.0],
        int(zeros),
        nonfinite,
        float(sums[positive].sum() - sums[negative].sum()),
        int(top),
    )


def _float_sums(
    counts: np.ndarray, mantissas: np.ndarray, squares: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each signed bin's float64 sum and sum of squares of |x| from its count and its
    integer sums of m and m^2 (the module: ``low + ulp m`` per value)."""
    sums, sq = np.zeros(counts.size), np.zeros(counts.size)
    at = np.flatnonzero(counts)
    j = np.minimum(at % SIGN_BIN, NBINS - 2)  # NaN/Inf's bins: no finite values
    low = bin_edges(j)[0]
    ulp = np.ldexp(1.0, np.maximum(j >> (23 - SHIFT), 1) - 150)
    n, m, m2 = (a[at].astype(np.float64) for a in (counts, mantissas, squares))
    sums[at] = n * low + ulp * m
    sq[at] = n * (low * low) + (2.0 * low * ulp) * m + (ulp * ulp) * m2
    return sums, sq


def gather_numpy(row: np.ndarray, bins) -> np.ndarray:
    """The plain reference of a gather: the |x| of the (ascending) ``bins``, grouped by
    bin in ascending order, each bin's in the row's order (zeros and NaN/Inf in none)."""
    a = np.abs(row)
    bits = a.view(np.uint32)
    index = bits >> SHIFT
    keep = np.isin(index, np.asarray(bins, np.uint32)) & (bits != 0) & np.isfinite(a)
    order = np.argsort(index[keep], kind="stable")
    return a[keep][order]


def gather_torch(values: torch.Tensor, bins) -> np.ndarray:
    """:func:`gather_numpy` by a stable ``torch.sort`` of the bins on the values' device."""
    a = values.reshape(-1).abs()
    index = a.view(torch.int32) >> SHIFT
    chosen = torch.as_tensor(np.asarray(bins, np.int64), device=a.device)
    keep = torch.isin(index, chosen) & (a != 0) & torch.isfinite(a)
    order = torch.sort(index[keep], stable=True).indices
    return a[keep][order].cpu().numpy()


def gather_compiled(row: np.ndarray, bins, counts: np.ndarray) -> np.ndarray:
    """:func:`gather_numpy`'s result by the numba loop (one pass, each value written to
    its bin's place); ``counts``: every bin's count (:class:`BinSums`)."""
    bins = np.asarray(bins, np.int64)
    starts = np.zeros(bins.size + 1, np.int64)
    np.cumsum(counts[bins], out=starts[1:])
    slot = np.full(NBINS, -1, np.int32)
    slot[bins] = np.arange(bins.size, dtype=np.int32)
    out = np.empty(int(starts[-1]), np.float32)
    _loops().gather(row, SHIFT, slot, starts[:-1], out)
    return out


def _loops():
    """:mod:`gradstat.stats._histogram_loops`, imported on first use (numba's start)."""
    if "gradstat.stats._histogram_loops" not in sys.modules:
        row_kernels.loops()  # the same cache folder rule as the row loops
    from gradstat.stats import _histogram_loops

    return _histogram_loops


def bin_edges(bins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) edge of each bin as float64: every |x| of bin j lies in [lower, upper)."""
    low = (bins.astype(np.uint32) << SHIFT).view(np.float32).astype(np.float64)
    high = ((bins.astype(np.uint32) + 1) << SHIFT).view(np.float32).astype(np.float64)
    return low, high


class RowHistogram:
    """The binned :class:`~gradstat.stats.row_statistics.RowStatistics` of one row
    ``values`` (signed, float32), and what a distribution fit asks besides. NaN and Inf
    stay out of the bins (``bins.nonfinite`` counts them); the answers that scan the row
    itself (thresholds at or below 0) want a finite row.

    ``compiled``: whether the numba pass builds the bins of a CPU float32 row (None:
    from ``COMPILED_MIN_NUMEL`` values; False: numpy's); other devices and dtypes use
    torch's. A bin's values are gathered when asked for (:meth:`prefetch`, or the first
    question that needs them); ``gathers`` counts those passes, ``gathered`` the values
    they read. Counts and sums are
    exact (float64 sums); :meth:`exceed` returns its set grouped by bin, not in the
    row's order.
    """

    def __init__(self, values: torch.Tensor, *, compiled: bool | None = None) -> None:
        self.values = values.reshape(-1)
        row = self._row = passes.plain_row(self.values)
        if compiled is None:
            compiled = row is not None and row.size >= COMPILED_MIN_NUMEL
        if row is not None and compiled:
            self.mode, self.bins = "compiled", bin_sums_compiled(row)
        elif row is not None:
            self.mode, self.bins = "numpy", bin_sums_numpy(row)
        else:
            self.mode, self.bins = "torch", bin_sums_torch(self.values.float())
        # above[j]: the |x| in bins j and up; the same for the sums (float64)
        self.above = np.zeros(NBINS + 1, np.int64)
        self.above[:-1] = np.cumsum(self.bins.counts[::-1])[::-1]
        self._above_sums = np.zeros(NBINS + 1)
        self._above_sums[:-1] = np.cumsum(self.bins.sums[::-1])[::-1]
        self._above_squares = np.zeros(NBINS + 1)
        self._above_squares[:-1] = np.cumsum(self.bins.squares[::-1])[::-1]
        self.nonzeros = int(self.above[0])
        self.gathers = self.gathered = 0
        self._kept: dict[int, np.ndarray] = {}
        self._sums: MagnitudeSums | None = None
        self._exceedance: dict[tuple[float, bool], ExceedanceSums] = {}

    @property
    def numel(self) -> int:
        return self.values.numel()

    # --- which bins -------------------------------------------------------------------
    def occupied(self) -> np.ndarray:
        """The bins holding some |x|, ascending."""
        return np.flatnonzero(self.bins.counts)

    # --- the values of the bins --------------------------------------------------------
    def prefetch(self, bins) -> None:
        """Read the values of those of ``bins`` not yet read, in one pass over the row (a
        row under ``PLAN_MIN_NUMEL``: every bin's)."""
        asked = np.unique(np.asarray(bins, np.int64))
        asked = asked[(asked >= 0) & (asked < NBINS)]
        wanted = [int(j) for j in asked if self.bins.counts[j] and int(j) not in self._kept]
        if wanted and self.numel < PLAN_MIN_NUMEL:
            wanted = [int(j) for j in self.occupied() if int(j) not in self._kept]
        if not wanted:
            return
        self.gathers += 1
        self.gathered += int(self.bins.counts[wanted].sum())
        if self.mode == "compiled":
            out = gather_compiled(self._row, wanted, self.bins.counts)
        elif self.mode == "numpy":
            out = gather_numpy(self._row, wanted)
        else:
            out = gather_torch(self.values.float(), wanted)
        starts = np.zeros(len(wanted) + 1, np.int64)
        np.cumsum(self.bins.counts[wanted], out=starts[1:])
        for at, j in enumerate(wanted):
            self._kept[j] = out[starts[at] : starts[at + 1]]

    def values_of(self, bins: np.ndarray) -> np.ndarray:
        """The |x| of the (ascending) ``bins``, grouped by bin, each bin's unordered."""
        self.prefetch(bins)
        parts = [self._kept[j] for j in (int(b) for b in bins) if self.bins.counts[j]]
        return np.concatenate(parts) if parts else np.empty(0, np.float32)

    def sketch(self) -> BinSketch:
        """This row's answers from its bins alone, for planning (:class:`BinSketch`)."""
        sketch = object.__new__(BinSketch)
        sketch.__dict__.update(self.__dict__)
        sketch._sums, sketch._exceedance, sketch.touched = None, {}, set()
        return sketch

    def planned(self, sketch: BinSketch) -> None:
        """Gather in one pass the bins ``sketch`` read and ``MARGIN`` either side (a
        level the sketch computed from stand-ins may fall just across a bin edge)."""
        touched = np.fromiter(sketch.touched, np.int64, len(sketch.touched))
        self.prefetch(np.add.outer(touched, np.arange(-MARGIN, MARGIN + 1)).ravel())

    def _split(self, limit: np.float32) -> tuple[int, np.ndarray]:
        """(bin of ``limit``, that bin's |x| >= limit)."""
        bits = int(np.float32(limit).view(np.uint32))
        j = bits >> SHIFT
        if j >= NBINS:
            return NBINS, np.empty(0, np.float32)
        values = self.values_of(np.array([j]))
        if bits & ((1 << SHIFT) - 1) == 0:  # on the bin's lower edge: all of it
            return j, values
        return j, values[values.view(np.uint32) >= bits]

    # --- what the threshold estimators ask (RowStatistics) ---------------------------
    def sums(self, log: bool = False) -> MagnitudeSums:
        """Count, sum and sum of squares of |x|, signed sum and maximum; the sum of
        ln|x| over the non-zeros when ``log`` (quadratic in each bin)."""
        if self._sums is None:
            b = self.bins
            maximum = float(np.uint32(b.top_bits).view(np.float32))
            total, squares = float(b.sums.sum()), float(b.squares.sum())
            require_finite_sums(total, squares)
            self._sums = MagnitudeSums(
                self.numel, self.nonzeros, total, squares, math.nan, b.signed_total, maximum
            )
        if log and math.isnan(self._sums.log_sum):
            self._sums = replace(self._sums, log_sum=self.expectation(np.log))
        return self._sums

    def count(self, threshold: float, inclusive: bool = False) -> int:
        """How many |x| exceed ``threshold`` (``>=`` when ``inclusive``), exactly."""
        if zeros_selected(threshold, inclusive):
            return passes.count(self.values, threshold, inclusive)
        limit = float32_limit(threshold, inclusive)
        if limit != limit:
            return 0
        j, part = self._split(limit)
        return int(self.above[min(j + 1, NBINS)]) + part.size

    def exceed(self, threshold: float, inclusive: bool = False) -> torch.Tensor:
        """The |x| above ``threshold`` (``>=`` when ``inclusive``), grouped by bin."""
        limit = float32_limit(threshold, inclusive)
        if zeros_selected(threshold, inclusive) or limit != limit:
            return passes.exceed(self.values, threshold, inclusive)
        j, part = self._split(limit)
        bins = self.occupied()
        return torch.from_numpy(np.concatenate([part, self.values_of(bins[bins > j])]))

    def exceedance_sums(self, threshold: float, inclusive: bool = False) -> ExceedanceSums:
        """Count, float64 sum and sum of squares, and minimum of :meth:`exceed`'s set."""
        key = (threshold, inclusive)
        if key in self._exceedance:
            return self._exceedance[key]
        limit = float32_limit(threshold, inclusive)
        if zeros_selected(threshold, inclusive) or limit != limit:
            above = passes.exceed(self.values, threshold, inclusive).double()
            n = above.numel()
            result = ExceedanceSums(
                n,
                float(above.sum()),
                float(above.square().sum()),
                float(above.amin()) if n else math.nan,
            )
        else:
            j, part = self._split(limit)
            nxt = min(j + 1, NBINS)
            wide = part.astype(np.float64)
            n = int(self.above[nxt]) + part.size
            total = float(self._above_sums[nxt]) + float(wide.sum())
            squares = float(self._above_squares[nxt]) + float(np.dot(wide, wide))
            if part.size:
                minimum = float(part.min())
            elif n:
                first = nxt + int(np.flatnonzero(self.bins.counts[nxt:])[0])
                minimum = float(self.values_of(np.array([first])).min())
            else:
                minimum = math.nan
            result = ExceedanceSums(n, total, squares, minimum)
        self._exceedance[key] = result
        return result

    def kth_largest(self, k: int, at_least: float | None = None) -> float:
        """The k-th largest |x| (1 <= k <= nonzeros), exactly, from its bin's values
        (``at_least`` is not needed: the counts say which bin)."""
        if not 1 <= k <= self.nonzeros:
            raise ValueError(f"k={k} outside 1..{self.nonzeros}")
        j = int(np.count_nonzero(self.above[:-1] >= k)) - 1
        rank = k - int(self.above[j + 1])  # from the top of bin j, 1-based
        values = self.values_of(np.array([j]))
        return float(np.partition(values, values.size - rank)[values.size - rank])

    # --- what a distribution fit asks ------------------------------------------------
    def _exact_sum(self, function, bins: np.ndarray) -> float:
        """sum of ``function(|x|)`` over the values of ``bins``, each value itself."""
        if bins.size == 0:
            return 0.0
        return float(np.sum(function(self.values_of(bins).astype(np.float64))))

    def rough_bins(self, function) -> tuple[np.ndarray, np.ndarray]:
        """The occupied bins :meth:`expectation` sums value by value: (subnormal bins,
        bins of normal floats where ``function`` is not finite on the edges or the
        points it takes)."""
        bins = self.occupied()
        normal = bins[bins >= (NORMAL_BITS >> SHIFT)]
        return bins[bins < (NORMAL_BITS >> SHIFT)], normal[~self._smooth(function, normal)[0]]

    @staticmethod
    def _smooth(function, bins: np.ndarray) -> tuple[np.ndarray, tuple]:
        """Whether ``function`` is finite on each bin's edges and at its centre c and
        c +- h/2 (h the half-width), and (c, h, f(c - h/2), f(c), f(c + h/2))."""
        low, high = bin_edges(bins)
        c, h = (low + high) / 2.0, (high - low) / 2.0
        with np.errstate(divide="ignore", invalid="ignore"):
            left, mid, right = function(c - h / 2), function(c), function(c + h / 2)
            ends = function(low) + function(high)
        return np.isfinite(left + mid + right + ends), (c, h, left, mid, right)

    def expectation(self, function) -> float:
        """sum of ``function(|x|)`` over the non-zeros: in each bin of normal floats the
        quadratic through ``function`` at the bin's centre c and c +- h/2 (h the
        half-width), summed with the bin's count, sum and sum of squares (exact for
        quadratics; the error per value is of order h^3 times the third derivative: with
        h 2^-9 of the value, 1e-8 relative and less for ln and the fitted log-densities);
        each value itself in the bins of :meth:`rough_bins` (subnormal bins are wide
        relative to their values; a log-density is -inf past the end of a bounded
        support)."""
        bins = self.occupied()
        normal = bins[bins >= (NORMAL_BITS >> SHIFT)]
        smooth, (c, h, left, mid, right) = self._smooth(function, normal)
        exact = self._exact_sum(function, bins[bins < (NORMAL_BITS >> SHIFT)])
        if not smooth.all():
            exact += self._exact_sum(function, normal[~smooth])
        if not smooth.any():
            return exact
        bins, c, h = normal[smooth], c[smooth], h[smooth]
        left, mid, right = left[smooth], mid[smooth], right[smooth]
        m = self.bins.counts[bins].astype(np.float64)
        s1 = self.bins.sums[bins] - m * c  # sum of (x - c)
        s2 = self.bins.squares[bins] - 2.0 * c * self.bins.sums[bins] + m * c * c
        slope = (right - left) / h
        curve = (right - 2.0 * mid + left) / (h * h / 4.0)
        return exact + float(np.sum(m * mid + slope * s1 + 0.5 * curve * s2))


class BinSketch(RowHistogram):
    """A :class:`RowHistogram` that reads nothing: the values of a bin not gathered yet
    are stand-ins (its count spread evenly over the bin), so counts, sums and levels come
    out approximate; :attr:`touched` notes every bin an answer read. What it is for:
    running the questions once to learn which bins the exact answers will read."""

    touched: set[int]

    def values_of(self, bins: np.ndarray) -> np.ndarray:
        occupied = [int(j) for j in bins if self.bins.counts[j]]
        self.touched.update(occupied)
        parts = [self._kept[j] if j in self._kept else self._spread(j) for j in occupied]
        return np.concatenate(parts) if parts else np.empty(0, np.float32)

    def _spread(self, j: int) -> np.ndarray:
        """count[j] values evenly spread over bin j (float32)."""
        size = int(self.bins.counts[j])
        low, high = (edge[0] for edge in bin_edges(np.array([j])))
        return (low + (np.arange(size) + 0.5) / size * (high - low)).astype(np.float32)
