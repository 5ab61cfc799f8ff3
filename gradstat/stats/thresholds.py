"""Threshold estimators: how a sparsifier picks about k of d gradient elements.

Each estimator looks at the magnitudes x = |g| of a signed flat vector g and returns a
threshold and the number of elements it selects; estimation quality q = selected / k
(1 is perfect). Every estimator is one :class:`Estimator` in :data:`ESTIMATORS` (its
function, the distribution it fits, whether it takes SIDCo's stage count, whether it
selects ``>=``); docs/methods.md section 2 gives each rule with its source:

* ``topk``: exact top-k; threshold = the k-th largest |g|.
* ``hard``: a fixed threshold lambda, select |g| >= lambda.
* ``sidco-exp`` / ``sidco-gpd`` / ``sidco-gamma-gpd``: SIDCo's multi-stage fits
  (:mod:`gradstat.stats.sidco`; Abdelmoniem et al. 2021, arXiv 2101.10761).
* ``dgc``: Deep Gradient Compression's sampled threshold (Lin et al. 2018, arXiv 1712.01887).
* ``gaussiank``: Gaussian-k (Shi et al. 2019, arXiv 1911.08772), at most 2 adjustments
  as the SIDCo reference applies them.
* ``redsync``: RedSync's binary search on mean + t (max - mean) (Fang et al. 2019,
  arXiv 1808.04357) until k < count < 2k; ``redsync-sidco``: the SIDCo reference's
  implementation of it (at most 3 probes).

Speed: no estimator sorts or selects over the whole vector; every question about it
goes through its :class:`~gradstat.stats.row_statistics.RowStatistics` (passes over the
vector, :mod:`gradstat.stats.passes`, or its bins, :mod:`gradstat.stats.histogram`).
Exact zeros are excluded from the fits and from the density (``zeros="exclude"``, the
quantile targeted is k / nnz) unless ``zeros="include"`` asks for the SIDCo reference's
rule. Values must be finite
(the analysis layer drops NaN/Inf first); a non-finite statistic raises
:class:`DataError`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from scipy.special import ndtri

from gradstat.defaults import FIT_ESTIMATORS
from gradstat.errors import DataError, UsageError
from gradstat.stats.density import check_k, k_for
from gradstat.stats.passes import RowPasses
from gradstat.stats.row_statistics import RowStatistics
from gradstat.stats.sidco import check_choices, sidco


@dataclass(frozen=True)
class ThresholdResult:
    """What an estimator chose: select ``|x| > threshold`` (``>=`` when ``inclusive``).

    ``densities`` and ``stage_thresholds`` describe SIDCo's stages (one entry per stage
    used); the densities multiply to k / (non-zeros) when every stage ran.
    """

    threshold: float
    selected: int
    k: int
    stages: int = 1
    estimator: str = ""
    inclusive: bool = False
    densities: tuple[float, ...] = ()
    stage_thresholds: tuple[float, ...] = ()

    @property
    def quality(self) -> float:
        """Estimation quality q = selected / k."""
        return self.selected / self.k


@dataclass(frozen=True)
class Settings:
    """What an estimator may be asked beyond the density: SIDCo's ``stages``, the hard
    ``threshold``, DGC's sampling ``generator`` (or its ``sampled`` threshold, drawn
    already: :func:`dgc_threshold`), how fits treat exact ``zeros``, how later SIDCo
    stages fit (``stage_fit``), and the questions asked of the vector (``shared``: its
    :class:`RowStatistics`, kept from call to call on the same vector)."""

    stages: int = 3
    threshold: float | None = None
    generator: torch.Generator | None = None
    zeros: str = "exclude"
    stage_fit: str = "moments"
    shared: RowStatistics | None = None
    sampled: float | None = None


@dataclass(frozen=True)
class Estimator:
    """One registered threshold estimator.

    ``select(values, k, settings)`` returns the threshold and its count
    (``settings.shared`` answers the questions about ``values``: :func:`estimate_threshold`
    makes one); ``dist`` names the distribution it fits (None: none); ``staged``: it takes
    SIDCo's stage count; ``inclusive``: it selects ``|x| >= threshold``.
    """

    select: Callable[[torch.Tensor, int, Settings], ThresholdResult]
    summary: str
    dist: str | None = None
    staged: bool = False
    inclusive: bool = False


def _sidco(first: str, later: str) -> Callable[[torch.Tensor, int, Settings], ThresholdResult]:
    def select(values: torch.Tensor, k: int, settings: Settings) -> ThresholdResult:
        stages = sidco(
            values,
            k,
            first=first,
            later=later,
            stages=settings.stages,
            zeros=settings.zeros,
            stage_fit=settings.stage_fit,
            shared=settings.shared,
        )
        return ThresholdResult(
            stages.threshold,
            stages.selected,
            k,
            stages=len(stages.thresholds),
            densities=stages.densities,
            stage_thresholds=stages.thresholds,
        )

    return select


def _topk(values: torch.Tensor, k: int, settings: Settings) -> ThresholdResult:
    """The k-th largest |g| (its sums first: NaN or Inf is an error)."""
    check_k(k, settings.shared.sums().nonzeros)
    return ThresholdResult(settings.shared.kth_largest(k), k, k)


def _hard(values: torch.Tensor, k: int, settings: Settings) -> ThresholdResult:
    threshold = settings.threshold
    if threshold is None or not math.isfinite(threshold) or threshold < 0:
        raise UsageError("the hard threshold needs a finite threshold >= 0")
    return ThresholdResult(threshold, settings.shared.count(threshold, inclusive=True), k)


def dgc_threshold(values: torch.Tensor, k: int, generator: torch.Generator | None) -> float:
    """DGC's first threshold for ``k`` of ``values``: the smallest of the top
    ceil(sample * delta) |x| of a uniform 1% sample (at least 2/delta) drawn with
    ``generator`` (random reads: 84k of 8M values cost 10-20 ms)."""
    flat = values.reshape(-1)
    d = flat.numel()
    density = k / d
    size = min(d, max(math.ceil(0.01 * d), math.ceil(2.0 / density)))
    index = torch.randint(d, (size,), generator=generator, device="cpu")
    sample = flat.index_select(0, index.to(flat.device)).abs()  # x[index]: 5-10x slower
    top = max(1, math.ceil(size * density))
    return float(torch.topk(sample, top, sorted=False).values.amin())


def _dgc(values: torch.Tensor, k: int, settings: Settings) -> ThresholdResult:
    """DGC: sample 1% of coordinates (at least 2/delta), take the smallest of the top
    ceil(sample * delta) sampled magnitudes; exact top-k on the candidates when more than
    1.3k are selected, threshold x0.8 and retry when fewer than 0.8k. Whether k non-zero
    values exist is asked only when the candidates do not show it (at least k of them at
    a threshold above 0): a count of the non-zeros is a pass over the row, 7 of the 65 ms
    of a replayed DGC step of 32M values."""
    flat = values.reshape(-1)
    threshold = settings.sampled
    if threshold is None:
        threshold = dgc_threshold(flat, k, settings.generator)
    if not math.isfinite(threshold):  # x0.8 would never bring NaN or Inf down
        raise DataError("the values contain NaN or Inf; drop them before estimating")
    counted, shared = False, settings.shared
    while True:
        selected = shared.count(threshold, inclusive=True)
        if not counted and not (threshold > 0 and selected >= k):
            check_k(k, shared.nonzeros)  # the errors of a check up front
            counted = True
        if selected > 1.3 * k:  # the top k of the candidates: the row's top k
            return ThresholdResult(shared.kth_largest(k, at_least=threshold), k, k)
        if selected >= 0.8 * k:
            return ThresholdResult(threshold, selected, k)
        threshold *= 0.8


#: Gaussian-k's adjustments applied at most (the SIDCo reference's loop applies 2).
GAUSSIANK_ADJUSTMENTS = 2


def _gaussiank(values: torch.Tensor, k: int, settings: Settings) -> ThresholdResult:
    """Gaussian-k: eta = mu + Phi^-1(1 - delta/2) sigma of the signed values (non-zeros,
    or every element with ``zeros="include"``) at delta = k / n; x0.5 when fewer than
    2k/3 are selected, x1.5 when more than 4k/3, at most twice (the reference computes a
    third adjustment and discards it)."""
    check_choices(settings.zeros, settings.stage_fit)
    passes = settings.shared
    sums = passes.sums()
    check_k(k, sums.nonzeros)
    n = sums.nonzeros if settings.zeros == "exclude" else sums.numel
    mean = sums.signed_total / n
    var = max(sums.squares / n - mean * mean, 0.0)
    threshold = mean + float(ndtri(1.0 - k / n / 2.0)) * math.sqrt(var)
    selected = passes.count(threshold)
    for _ in range(GAUSSIANK_ADJUSTMENTS):
        if 2 * k / 3 <= selected <= 4 * k / 3:
            break
        threshold *= 0.5 if selected < 2 * k / 3 else 1.5
        selected = passes.count(threshold)
    return ThresholdResult(threshold, selected, k)


def _bisection(probes: int, lower_below: Callable[[int], float]):
    """RedSync's binary search of t in [0, 1] for eta = mean + t (max - mean) of |x|, the
    mean over every element (zeros included, as RedSync has it): at most ``probes``
    probes, stopping when k < count < 2k; eta is lowered when the count is under
    ``lower_below(k)``, else raised. The last probe's threshold is used, whatever it
    selects. Counts run on the smallest set of exceedances kept so far
    (:class:`RowPasses`), or on the row's bins."""

    def select(values: torch.Tensor, k: int, settings: Settings) -> ThresholdResult:
        stats = settings.shared
        check_k(k, stats.nonzeros)
        sums = stats.sums()
        mean, top = sums.total / sums.numel, sums.maximum
        low, high = 0.0, 1.0
        for _ in range(probes):
            t = low + (high - low) / 2.0
            threshold = mean + t * (top - mean)
            selected = stats.count(threshold)
            if k < selected < 2 * k:
                break
            if selected < lower_below(k):
                high = t
            else:
                low = t
        return ThresholdResult(threshold, selected, k)

    return select


#: RedSync (Fang et al. 2019): up to 40 probes; eta lowered when count <= k, raised
#: when count >= 2k.
_redsync = _bisection(40, lambda k: k + 1)
#: The SIDCo reference's RedSync (``RedSyncCompressor``): bisect while the interval is
#: wider than 0.2 (3 probes); eta lowered when count < k/2, otherwise raised (also
#: when k/2 <= count <= k).
_redsync_sidco = _bisection(3, lambda k: k / 2)


ESTIMATORS: dict[str, Estimator] = {
    "topk": Estimator(_topk, "exact top-k", inclusive=True),
    "hard": Estimator(_hard, "fixed threshold |g| >= lambda", inclusive=True),
    "sidco-exp": Estimator(_sidco("exp", "exp"), "SIDCo-E: exponential stages", "exp", True),
    "sidco-gpd": Estimator(_sidco("gpd", "gpd"), "SIDCo-P: GPD stages", "gpd", True),
    "sidco-gamma-gpd": Estimator(
        _sidco("gamma", "gpd"), "SIDCo-GP: gamma, then GPD stages", "gamma+gpd", True
    ),
    "dgc": Estimator(_dgc, "DGC: top-k of a 1% sample", inclusive=True),
    "gaussiank": Estimator(_gaussiank, "Gaussian-k: normal quantile, 2 adjustments", "normal"),
    "redsync": Estimator(_redsync, "RedSync: bisection until k < count < 2k"),
    "redsync-sidco": Estimator(
        _redsync_sidco, "RedSync as the SIDCo reference runs it (<= 3 probes)"
    ),
}
#: Estimators ``fit`` runs by default (declared in :mod:`gradstat.defaults`, which the
#: command line's help reads without importing torch).
DEFAULT_ESTIMATORS: tuple[str, ...] = FIT_ESTIMATORS


def get_estimator(name: str) -> Estimator:
    """The estimator called ``name``; :class:`UsageError` naming the choices otherwise."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise UsageError(
            f"unknown estimator {name!r}; choose from {', '.join(ESTIMATORS)}"
        ) from None


def estimate_threshold(
    values: torch.Tensor,
    ratio: float,
    estimator: str,
    *,
    stages: int = 3,
    threshold: float | None = None,
    generator: torch.Generator | None = None,
    zeros: str = "exclude",
    stage_fit: str = "moments",
    shared: RowStatistics | None = None,
    sampled: float | None = None,
) -> ThresholdResult:
    """Estimate the threshold that keeps about ``k = k_for(ratio, values.numel())``.

    ``values`` is the signed flat vector (Gaussian-k needs the sign); every estimator
    thresholds ``|values|``. ``stages`` is SIDCo's stage count M, ``threshold`` the
    ``hard`` estimator's lambda, ``generator`` DGC's sampling generator; ``zeros``
    (``exclude``/``include``) and ``stage_fit`` (``moments``/``mle``) choose how the
    fitting estimators (SIDCo, Gaussian-k) treat exact zeros and later SIDCo stages;
    ``shared``: the :class:`RowStatistics` of ``values``, kept for further calls on the
    same ``values`` (default: a fresh :class:`RowPasses`); ``sampled``: DGC's sampled
    threshold when the caller drew it (:func:`dgc_threshold`; the draw is the slow part
    of a DGC call).
    Raises :class:`UsageError` for an unknown estimator or choice, a ratio outside
    (0, 1), a stage count below 1 or k above the number of non-zeros;
    :class:`DataError` for an all-zero or non-finite vector.
    """
    entry = get_estimator(estimator)
    if not (0.0 < ratio < 1.0):
        raise UsageError(f"ratio {ratio} is outside (0, 1)")
    if stages < 1:
        raise UsageError(f"stages must be at least 1, got {stages}")
    check_choices(zeros, stage_fit)
    if values.numel() == 0:
        raise DataError("no values to threshold (empty vector)")
    shared = shared or RowPasses(values)
    settings = Settings(stages, threshold, generator, zeros, stage_fit, shared, sampled)
    result = entry.select(values, k_for(ratio, values.numel()), settings)
    return replace(result, estimator=estimator, inclusive=entry.inclusive)


__all__ = [
    "DEFAULT_ESTIMATORS",
    "ESTIMATORS",
    "Estimator",
    "Settings",
    "ThresholdResult",
    "dgc_threshold",
    "estimate_threshold",
    "get_estimator",
]
