"""One pass per row for every count, sum, quantile and goodness-of-fit question of ``fit``.

Non-negative float32 values order as their bit patterns do as integers, so the bins
``bits(|x|) >> SHIFT`` (2^8 bins an octave, each 2^-8 of its value wide) are intervals of
|x| in ascending order. One pass (``bin_sums_*``) takes each bin's count, float64 sum and
sum of squares, and the row's zeros, signed sum and maximum. A count at a bin edge is then
exact from the counts alone; a count at any other threshold is exact from the counts
above the threshold's bin plus a count over that bin's own values.

Those values come from :func:`gather`: one more pass over the row that reads the values
of only the bins asked for. To ask for them at once, a long row's records are computed
*tentatively* first (:meth:`RowHistogram.tentative`): a bin whose values were not read
answers with stand-ins (its count spread evenly over it) and is noted; those bins (+-
``MARGIN``) are then gathered in one pass and the records computed again, exactly
(the row before does not foretell those bins: docs/large.md). The run after asks
for another bin rarely (a stand-in answer that steered a search elsewhere); each such
miss is one more gather (``RowHistogram.gathers`` counts them). A row under
``PLAN_MIN_NUMEL`` values gathers all its bins on the first question instead.

The compiled pass sums integers: in bin j every value is ``low_j + ulp_j m`` with m the
bit pattern's low ``SHIFT`` bits, so the bin's sum is ``n low + ulp sum(m)`` and its sum
of squares ``n low^2 + 2 low ulp sum(m) + ulp^2 sum(m^2)``, each rounded once to float64
(the numpy and torch builds add float64 values, rounding at every add). It bins the
signed bit patterns (the sign the top bit of the bin index), so the signed sum is the
positive bins' sum less the negative bins'.

:class:`RowHistogram` answers what the threshold estimators ask of a row (the interface of
:class:`~gradstat.stats.passes.RowPasses`) and what a distribution fit needs: the moments
of every non-zero |x|, the k-th largest |x|, sums of a smooth function over every value
(the log-likelihood, the log sum; quadratic in each bin, error below 1e-8 relative), and
KS and Anderson-Darling on the whole row (:mod:`gradstat.stats.histogram_fit`).

Three builds of the bins and of a gather, the same numbers: numpy (``*_numpy``: the
plain references), numba (``*_compiled``, :mod:`gradstat.stats._histogram_loops`; CPU
rows of ``COMPILED_MIN_NUMEL`` or more) and torch (``*_torch``: ``torch.bincount`` and a
stable sort of the bit patterns on any device, e.g. ``--device cuda``).
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from gradstat.stats import passes as row_passes
from gradstat.stats.passes import ExceedanceSums, MagnitudeSums
from gradstat.stats.row_kernels import float32_limit

#: Bits below the bin index: 23 - 15 = 8 mantissa bits in the bin, 2^8 bins an octave.
SHIFT = 15
#: Bins of non-negative finite float32 values, and one more for +inf (thresholds).
NBINS = (0x7F800000 >> SHIFT) + 1
#: Bins either side of each bin a tentative run missed that the gather reads too.
MARGIN = 1
#: Rows from this size gather the bins a tentative run asks for; shorter: every bin.
PLAN_MIN_NUMEL = 1 << 21
#: Bit patterns below this are subnormal.
NORMAL_BITS = 0x00800000
#: Signed bin j + SIGN_BIN holds the negative values of bin j (the compiled pass).
SIGN_BIN = 1 << (31 - SHIFT)
_CHUNK = 1 << 18
#: The compiled loops start (numba's import, about 0.7 s once a process) from this size.
COMPILED_MIN_NUMEL = row_passes.COMPILED_MIN_NUMEL


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
    sums are closer to the exact ones."""
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
        from gradstat.stats import row_kernels

        row_kernels._loops()  # the same cache folder rule as the row loops
    from gradstat.stats import _histogram_loops

    return _histogram_loops


def bin_edges(bins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) edge of each bin as float64: every |x| of bin j lies in [lower, upper)."""
    low = (bins.astype(np.uint32) << SHIFT).view(np.float32).astype(np.float64)
    high = ((bins.astype(np.uint32) + 1) << SHIFT).view(np.float32).astype(np.float64)
    return low, high


def _plain(values: torch.Tensor) -> np.ndarray | None:
    if values.device.type == "cpu" and values.dtype == torch.float32 and values.is_contiguous():
        return values.reshape(-1).numpy()
    return None


class RowHistogram:
    """The bins of one row ``values`` (signed, float32) and what they answer. NaN and Inf
    stay out of the bins (``bins.nonfinite`` counts them); the answers that scan the row
    itself (thresholds at or below 0) want a finite row.

    ``compiled``: the numba pass may build the bins of a long CPU row (False: numpy's);
    other devices and dtypes use torch's. A bin's values are gathered on the first
    question they must answer (see the module); ``gathers`` counts those passes. Counts
    and sums are exact (float64 sums); :meth:`exceed` returns its set grouped by bin, not
    in the row's order.
    """

    def __init__(self, values: torch.Tensor, *, compiled: bool = True) -> None:
        self.values = values.reshape(-1)
        row = _plain(self.values) if values.dtype == torch.float32 else None
        self._row = row
        self._kept: dict[int, np.ndarray] = {}
        if row is not None and compiled and row.size >= COMPILED_MIN_NUMEL:
            self.mode = "compiled"
            self.bins = bin_sums_compiled(row)
        elif row is not None:
            self.mode = "numpy"
            self.bins = bin_sums_numpy(row)
        else:
            self.mode = "torch"
            self.bins = bin_sums_torch(self.values.float())
        counts = self.bins.counts
        # above[j]: the |x| in bins j and up; the same for the sums (float64)
        self.above = np.zeros(NBINS + 1, np.int64)
        self.above[:-1] = np.cumsum(counts[::-1])[::-1]
        self._above_sums = np.zeros(NBINS + 1)
        self._above_sums[:-1] = np.cumsum(self.bins.sums[::-1])[::-1]
        self._above_squares = np.zeros(NBINS + 1)
        self._above_squares[:-1] = np.cumsum(self.bins.squares[::-1])[::-1]
        self.nonzeros = int(self.above[0])
        self.gathers = 0
        self._missing: set[int] | None = None
        self._sums: MagnitudeSums | None = None
        self._exceedance: dict[tuple[float, bool], ExceedanceSums] = {}
        #: answers that depend on the row alone, kept for the estimators (a tentative run
        #: and the run after it: e.g. DGC's sampled threshold)
        self.memo: dict = {}

    @property
    def numel(self) -> int:
        return self.values.numel()

    @property
    def plans(self) -> bool:
        """Whether the row is long enough to gather only the bins asked for
        (``PLAN_MIN_NUMEL``): its records are computed tentatively first."""
        return self.numel >= PLAN_MIN_NUMEL

    # --- the values of the bins --------------------------------------------------------
    @contextmanager
    def tentative(self):
        """Inside: a bin whose values were not read answers with stand-ins (its count
        spread evenly over it) and is noted. On leaving, when a bin was noted (yields a
        list that then holds the noted bins): forget the answers and gather those bins,
        ``MARGIN`` either side, in one pass; the caller computes its answers again."""
        self._missing = set()
        missed: list[int] = []
        try:
            yield missed
        finally:
            missed.extend(sorted(self._missing))
            self._missing = None
        if missed:
            self._sums = None
            self._exceedance.clear()
            near = np.add.outer(np.array(missed), np.arange(-MARGIN, MARGIN + 1)).ravel()
            self.prefetch(near[(near >= 0) & (near < NBINS)])

    def _spread(self, bins: np.ndarray) -> np.ndarray:
        """Stand-ins for the values of ``bins`` in a tentative run: count[j] values evenly
        spread over each bin j (float32, grouped by bin)."""
        sizes = self.bins.counts[bins]
        low, high = bin_edges(bins)
        first = np.repeat(np.cumsum(sizes) - sizes, sizes)
        at = (np.arange(int(sizes.sum())) - first + 0.5) / np.repeat(sizes, sizes)
        return (np.repeat(low, sizes) + at * np.repeat(high - low, sizes)).astype(np.float32)

    def _values(self, bins: np.ndarray) -> np.ndarray:
        """The |x| of the (ascending, occupied) ``bins``, grouped by bin: read ones, or
        in a tentative run stand-ins for those not read."""
        self.prefetch(bins)
        parts = [
            self._kept[j] if j in self._kept else self._spread(np.array([j]))
            for j in (int(b) for b in bins)
        ]
        return np.concatenate(parts) if parts else np.empty(0, np.float32)

    def bin_values(self, j: int) -> np.ndarray:
        """The |x| of bin ``j`` (float32, unordered within the bin)."""
        if not self.bins.counts[j]:
            return np.empty(0, np.float32)
        return self._values(np.array([j]))

    def _tail(self, j: int) -> np.ndarray:
        """The |x| of the bins above bin ``j``, grouped by bin."""
        bins = self.occupied()
        return self._values(bins[bins > j])

    def prefetch(self, bins) -> None:
        """Read the values of those of ``bins`` not yet read in one pass over the row (a
        row under ``PLAN_MIN_NUMEL``: every bin's); in a tentative run, note them."""
        asked = np.unique(np.asarray(bins, np.int64))
        wanted = [int(j) for j in asked if self.bins.counts[j] and int(j) not in self._kept]
        if self._missing is not None:
            self._missing.update(wanted)
            return
        if not self.plans:
            wanted = [int(j) for j in self.occupied() if int(j) not in self._kept]
        if not wanted:
            return
        self.gathers += 1
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

    def _split(self, limit: np.float32) -> tuple[int, np.ndarray]:
        """(bin of ``limit``, that bin's |x| >= limit)."""
        bits = int(np.float32(limit).view(np.uint32))
        j = bits >> SHIFT
        if j >= NBINS:
            return NBINS, np.empty(0, np.float32)
        if bits & ((1 << SHIFT) - 1) == 0:  # on the bin's lower edge: all of it
            return j, self.bin_values(j) if self.bins.counts[j] else np.empty(0, np.float32)
        values = self.bin_values(j) if self.bins.counts[j] else np.empty(0, np.float32)
        return j, values[values.view(np.uint32) >= bits]

    # --- what the threshold estimators ask (RowPasses' interface) --------------------
    def sums(self, log: bool = False) -> MagnitudeSums:
        """Count, sum and sum of squares of |x|, signed sum and maximum; the sum of
        ln|x| over the non-zeros when ``log`` (quadratic in each bin)."""
        if self._sums is None:
            b = self.bins
            maximum = float(np.uint32(b.top_bits).view(np.float32))
            total, squares = float(b.sums.sum()), float(b.squares.sum())
            row_passes._require_finite_sums(total, squares)
            self._sums = MagnitudeSums(
                self.numel, self.nonzeros, total, squares, math.nan, b.signed_total, maximum
            )
        if log and math.isnan(self._sums.log_sum):
            log_sum = self.expectation(np.log)
            self._sums = MagnitudeSums(**{**self._sums.__dict__, "log_sum": log_sum})
        return self._sums

    def count(self, threshold: float, inclusive: bool = False) -> int:
        """How many |x| exceed ``threshold`` (``>=`` when ``inclusive``), exactly."""
        if row_passes.zeros_selected(threshold, inclusive):
            return row_passes.count(self.values, threshold, inclusive)
        limit = float32_limit(threshold, inclusive)
        if limit != limit:
            return 0
        j, part = self._split(limit)
        return int(self.above[min(j + 1, NBINS)]) + part.size

    def exceed(self, threshold: float, inclusive: bool = False) -> torch.Tensor:
        """The |x| above ``threshold`` (``>=`` when ``inclusive``), grouped by bin."""
        limit = float32_limit(threshold, inclusive)
        if row_passes.zeros_selected(threshold, inclusive) or limit != limit:
            return row_passes.exceed(self.values, threshold, inclusive)
        j, part = self._split(limit)
        if j >= NBINS:
            return torch.from_numpy(part)
        return torch.from_numpy(np.concatenate([part, self._tail(j)]))

    def exceedance_sums(self, threshold: float, inclusive: bool = False) -> ExceedanceSums:
        """Count, float64 sum and sum of squares, and minimum of :meth:`exceed`'s set."""
        key = (threshold, inclusive)
        if key in self._exceedance:
            return self._exceedance[key]
        limit = float32_limit(threshold, inclusive)
        if row_passes.zeros_selected(threshold, inclusive) or limit != limit:
            above = row_passes.exceed(self.values, threshold, inclusive).double()
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
                minimum = float(self.bin_values(first).min())
            else:
                minimum = math.nan
            result = ExceedanceSums(n, total, squares, minimum)
        self._exceedance[key] = result
        return result

    # --- what a distribution fit asks ------------------------------------------------
    def kth_largest(self, k: int, at_least: float = 0.0) -> float:
        """The k-th largest |x| (1 <= k <= nonzeros), exactly (``at_least``: the
        interface of :meth:`RowPasses.kth_largest`, not needed here)."""
        if not 1 <= k <= self.nonzeros:
            raise ValueError(f"k={k} outside 1..{self.nonzeros}")
        j = int(np.count_nonzero(self.above[:-1] >= k)) - 1
        rank = k - int(self.above[j + 1])  # from the top of bin j, 1-based
        values = self.bin_values(j)
        return float(np.partition(values, values.size - rank)[values.size - rank])

    def occupied(self) -> np.ndarray:
        """The bins holding some |x|, ascending."""
        return np.flatnonzero(self.bins.counts)

    def _exact_sum(self, function, bins: np.ndarray) -> float:
        """sum of ``function(|x|)`` over the values of ``bins``, each value itself."""
        if bins.size == 0:
            return 0.0
        self.prefetch(bins)
        values = np.concatenate([self.bin_values(int(j)) for j in bins])
        return float(np.sum(function(values.astype(np.float64))))

    def expectation(self, function) -> float:
        """sum of ``function(|x|)`` over the non-zeros: in each bin of normal floats the
        quadratic through ``function`` at the bin's centre c and c +- h/2 (h the
        half-width), summed with the bin's count, sum and sum of squares (exact for
        quadratics; the error per value is of order h^3 times the third derivative: with
        h 2^-9 of the value, 1e-8 relative and less for ln and the fitted log-densities);
        each subnormal value itself (their bins are wide relative to their values), and
        each value of a bin where ``function`` is not finite on its edges or those points."""
        counts = self.bins.counts
        bins = np.flatnonzero(counts)
        exact = self._exact_sum(function, bins[bins < (NORMAL_BITS >> SHIFT)])
        bins = bins[bins >= (NORMAL_BITS >> SHIFT)]
        if bins.size == 0:
            return exact
        low, high = bin_edges(bins)
        c, h = (low + high) / 2.0, (high - low) / 2.0
        left, mid, right = function(c - h / 2), function(c), function(c + h / 2)
        # a bin's values taken one by one where function is not finite on its edges or
        # points (e.g. a log-density's -inf past the end of a bounded support)
        smooth = np.isfinite(left + mid + right + function(low) + function(high))
        if not smooth.all():
            exact += self._exact_sum(function, bins[~smooth])
            bins, c, h = bins[smooth], c[smooth], h[smooth]
            left, mid, right = left[smooth], mid[smooth], right[smooth]
        m = counts[bins].astype(np.float64)
        s1 = self.bins.sums[bins] - m * c  # sum of (x - c)
        s2 = self.bins.squares[bins] - 2.0 * c * self.bins.sums[bins] + m * c * c
        slope = (right - left) / h
        curve = (right - 2.0 * mid + left) / (h * h / 4.0)
        return exact + float(np.sum(m * mid + slope * s1 + 0.5 * curve * s2))
