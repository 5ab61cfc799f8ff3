"""What the threshold estimators and the fit ask of one row: the interface, and its
two implementations' shared answers.

:class:`RowStatistics` is the declared interface. Two classes implement it:

* :class:`~gradstat.stats.passes.RowPasses`, exact by passes over the row's values
  (kept exceedance sets answer later questions; the estimators' default, and the
  replay's);
* :class:`~gradstat.stats.histogram.RowHistogram`, the binned form: one pass of bins
  answers counts and sums exactly, the values of a few bins the rest (``fit``'s).

Both answer every question exactly: counts, k-th largest values and exceedance sets
equal a brute-force scan of the row; sums are float64 sums of the same values (the
binned ones rounded differently).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from gradstat.errors import DataError


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


@dataclass(frozen=True)
class ExceedanceSums:
    """Count, sum and sum of squares, and minimum of the magnitudes above a level (what a
    later SIDCo stage fits); ``minimum`` is NaN when none is."""

    n: int
    total: float
    squares: float
    minimum: float


class RowStatistics(Protocol):
    """The questions asked of one signed, finite row (``|x|`` its magnitudes).

    ``count`` and ``exceed`` select ``|x| > threshold`` (``>=`` when ``inclusive``),
    compared in float32 as numpy compares a float32 array with a Python float.
    """

    @property
    def numel(self) -> int:
        """Values in the row."""

    @property
    def nonzeros(self) -> int:
        """Values of the row that are not exactly zero."""

    def sums(self, log: bool = False) -> MagnitudeSums:
        """The row's sums (with the sum of ln|x| over the non-zeros when ``log``);
        :class:`DataError` when a sum is not finite."""

    def count(self, threshold: float, inclusive: bool = False) -> int:
        """How many |x| pass ``threshold``."""

    def exceed(self, threshold: float, inclusive: bool = False) -> torch.Tensor:
        """The |x| that pass ``threshold`` (their order is the implementation's)."""

    def exceedance_sums(self, threshold: float, inclusive: bool = False) -> ExceedanceSums:
        """Count, sums and minimum of :meth:`exceed`'s set."""

    def kth_largest(self, k: int, at_least: float | None = None) -> float:
        """The k-th largest |x| (1 <= k <= nonzeros); ``at_least``: a level at least k
        of them reach, when the caller knows one."""


def require_finite_sums(total: float, squares: float) -> None:
    """The check every way of taking a row's sums ends with: a NaN or Inf value makes
    its sums NaN or Inf, which is a :class:`DataError`."""
    if not (math.isfinite(total) and math.isfinite(squares)):
        raise DataError("the values contain NaN or Inf; drop them before estimating")


def zeros_selected(threshold: float, inclusive: bool) -> bool:
    """Whether zeros pass ``|x| > threshold`` (``>=`` when inclusive) as float32 compares
    (the threshold rounded to float32: a positive one under half the smallest subnormal
    is 0), or the threshold is NaN: then sets of non-zero magnitudes cannot answer."""
    if math.isnan(threshold):
        return True
    with np.errstate(over="ignore"):  # a huge threshold is +inf in float32
        return threshold < 0 or (inclusive and np.float32(threshold) <= 0)
