"""Threshold estimators: how a sparsifier picks about k of d gradient elements.

Each estimator looks at the magnitudes x = |g| of a signed flat vector g and returns a
threshold and the number of elements it selects; estimation quality q = selected / k
(1 is perfect). The rules follow METHODS.md section 2:

* ``topk``: exact top-k (``torch.topk``); threshold = the k-th largest |g|.
* ``hard``: a fixed threshold lambda, select |g| >= lambda.
* ``sidco-exp`` / ``sidco-gpd`` / ``sidco-gamma-gpd``: SIDCo's multi-stage peak over
  threshold fits (Abdelmoniem et al. 2021, arXiv 2101.10761): exponential at every stage,
  generalized Pareto at every stage, gamma then generalized Pareto.
* ``dgc``: Deep Gradient Compression's sampled threshold (Lin et al. 2018, arXiv 1712.01887).
* ``gaussiank``: Gaussian-k (Shi et al. 2019, arXiv 1911.08772).
* ``redsync``: RedSync's binary search on mean + t (max - mean) (Fang et al. 2019,
  arXiv 1808.04357).

Speed: no estimator but ``topk`` sorts or selects over the whole vector. Passes over
the full vector run in cache-sized chunks (abs, compare and compact in one go), sums are
accumulated per chunk in float32 (torch's cascade summation) and across chunks in float64.
Exact zeros are excluded from the fits and from the density: the quantile targeted is
k / (number of non-zeros). Values must be finite (the analysis layer drops NaN/Inf first);
a non-finite statistic raises :class:`DataError`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
from scipy.special import ndtri

from gradstat.errors import DataError, UsageError
from gradstat.stats.distributions import Exponential, Gamma, GenPareto

ESTIMATORS: tuple[str, ...] = (
    "topk",
    "hard",
    "sidco-exp",
    "sidco-gpd",
    "sidco-gamma-gpd",
    "dgc",
    "gaussiank",
    "redsync",
)
#: Estimators that take a stage count (SIDCo).
SIDCO_ESTIMATORS: tuple[str, ...] = ("sidco-exp", "sidco-gpd", "sidco-gamma-gpd")
#: SIDCo's first-stage density when more than one stage is used (METHODS.md 2).
FIRST_STAGE_DENSITY = 0.25
_CHUNK = 1 << 20  # 4 MiB of float32: few parallel regions, temporaries stay in L2/L3
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class ThresholdResult:
    """What an estimator chose: select ``|x| > threshold`` (``>=`` when ``inclusive``).

    ``densities`` and ``stage_thresholds`` describe SIDCo's stages (one entry per stage
    used); the densities multiply to k / (non-zeros) when every stage ran.
    """

    threshold: float
    selected: int
    k: int
    stages: int
    estimator: str = ""
    inclusive: bool = False
    densities: tuple[float, ...] = ()
    stage_thresholds: tuple[float, ...] = ()

    @property
    def quality(self) -> float:
        """Estimation quality q = selected / k."""
        return self.selected / self.k

    def mask(self, values: torch.Tensor) -> torch.Tensor:
        """Boolean mask of the elements of ``values`` (signed) that this threshold selects.

        For ``topk`` with ties at the k-th largest magnitude the mask can hold more than k.
        """
        x = values.abs()
        return x >= self.threshold if self.inclusive else x > self.threshold


@dataclass(frozen=True)
class _Stats:
    """Count, mean, variance and mean log of a set of magnitudes."""

    n: int
    mean: float
    var: float
    mean_log: float


def _chunks(values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return values.reshape(-1).split(_CHUNK)


def _stats(values: torch.Tensor, *, log: bool = False) -> _Stats:
    """Statistics of the non-zero ``|values|`` (exact zeros excluded and counted).

    One chunked pass; per-chunk float32 sums, float64 across chunks. The log sum skips
    zeros by clamping them to the smallest normal float and removing their contribution.
    """
    sums, squares, logs, nonzeros = [], [], [], []
    for chunk in _chunks(values):
        a = chunk.abs()
        sums.append(a.sum())
        squares.append(a.square().sum())
        if log:
            logs.append(a.clamp_min(_TINY).log().sum())
        nonzeros.append(torch.count_nonzero(a))
    total = values.numel()
    n = int(torch.stack(nonzeros).sum())
    if n == 0:
        raise DataError("all values are exactly zero: nothing to fit")
    s1 = float(torch.stack(sums).double().sum())
    s2 = float(torch.stack(squares).double().sum())
    mean = s1 / n
    var = max(s2 / n - mean * mean, 0.0)
    mean_log = math.nan
    if log:
        s_log = float(torch.stack(logs).double().sum()) - (total - n) * math.log(_TINY)
        mean_log = s_log / n
    if not (math.isfinite(mean) and math.isfinite(var)):
        raise DataError("the values contain NaN or Inf; drop them before estimating")
    return _Stats(n, mean, var, mean_log)


def _excess_stats(exceed: torch.Tensor, minimum: float) -> _Stats:
    """Mean and variance of the excesses ``exceed - minimum`` (a later SIDCo stage), from
    float32 sums of the exceedances themselves: no shifted copy. The spread of a tail is
    comparable to its level, so E[y^2] - E[y]^2 keeps ~6 digits."""
    n = exceed.numel()
    mean = float(exceed.sum()) / n
    var = max(float(exceed.square().sum()) / n - mean * mean, 0.0)
    return _Stats(n, mean - minimum, var, math.nan)


def _exceed(values: torch.Tensor, threshold: float, inclusive: bool = False) -> torch.Tensor:
    """The magnitudes above ``threshold``, compacted chunk by chunk."""
    parts = []
    for chunk in _chunks(values):
        a = chunk.abs()
        parts.append(a[a >= threshold] if inclusive else a[a > threshold])
    return torch.cat(parts)


def _count(values: torch.Tensor, threshold: float, inclusive: bool = False) -> int:
    """How many magnitudes exceed ``threshold``."""
    counts = [
        torch.count_nonzero(a >= threshold if inclusive else a > threshold)
        for a in (chunk.abs() for chunk in _chunks(values))
    ]
    return int(torch.stack(counts).sum())


def _nonzeros(values: torch.Tensor) -> int:
    """Number of non-zero elements (a cheap minimum first: gradients rarely hold zeros)."""
    if values.numel() and float(values.abs().amin()) > 0:
        return values.numel()
    return int(torch.count_nonzero(values))


# --- closed-form upper quantiles of SIDCo's fits (METHODS.md 1) ---------------------------
def exponential_quantile(stats: _Stats, density: float) -> float:
    """Exponential MLE beta = mean; eta = -beta ln(density)."""
    return float(Exponential.from_mean(stats.mean).isf(density))


def gpd_quantile(stats: _Stats, density: float) -> float:
    """GPD by moments; eta = (sigma/xi)(density^-xi - 1), -sigma ln(density) as xi -> 0.
    Values without spread (var = 0) give their common level."""
    if stats.var <= 0.0:
        return stats.mean
    return float(GenPareto.from_moments(stats.mean, stats.var).isf(density))


def gamma_quantile(stats: _Stats, density: float) -> float:
    """SIDCo's closed-form gamma; eta = scale * Q^-1(a, density) (upper regularised
    incomplete gamma inverse). Values without spread give their common level."""
    if not math.log(stats.mean) - stats.mean_log > 0.0:
        return stats.mean
    return float(Gamma.from_log_moments(stats.mean, stats.mean_log).isf(density))


_QUANTILES = {"exp": exponential_quantile, "gpd": gpd_quantile, "gamma": gamma_quantile}
_SIDCO_FITS = {
    "sidco-exp": ("exp", "exp"),
    "sidco-gpd": ("gpd", "gpd"),
    "sidco-gamma-gpd": ("gamma", "gpd"),
}


def stage_densities(density: float, stages: int) -> tuple[float, ...]:
    """SIDCo's per-stage densities: 0.25 first (when density < 0.25 and stages > 1), then
    equal shares ``(density / 0.25)^(1/(stages-1))``; they multiply to ``density``."""
    if stages == 1 or density >= FIRST_STAGE_DENSITY:
        return (density,)
    per = (density / FIRST_STAGE_DENSITY) ** (1.0 / (stages - 1))
    return (FIRST_STAGE_DENSITY,) + (per,) * (stages - 1)


def _sidco(values: torch.Tensor, k: int, estimator: str, stages: int) -> ThresholdResult:
    first, later = _SIDCO_FITS[estimator]
    stats = _stats(values, log=first == "gamma")
    _check_k(k, stats.n)
    densities = stage_densities(k / stats.n, stages)
    eta = _QUANTILES[first](stats, densities[0])
    thresholds = [eta]
    current = values  # the full signed vector, then each stage's exceedances (magnitudes)
    for density in densities[1:]:
        exceed = _exceed(values, eta) if current is values else current[current > eta]
        if exceed.numel() < 2:
            break  # nothing left to fit: keep the previous stage's threshold
        minimum = float(exceed.amin())
        eta = minimum + _QUANTILES[later](_excess_stats(exceed, minimum), density)
        thresholds.append(eta)
        current = exceed
    used = len(thresholds)
    selected = _count(values, eta) if current is values else int(torch.count_nonzero(current > eta))
    return ThresholdResult(
        threshold=eta,
        selected=selected,
        k=k,
        stages=used,
        estimator=estimator,
        densities=densities[:used],
        stage_thresholds=tuple(thresholds),
    )


def _topk(values: torch.Tensor, k: int) -> ThresholdResult:
    _check_k(k, _nonzeros(values))
    kth = float(torch.topk(values.reshape(-1).abs(), k, sorted=False).values.amin())
    if math.isnan(kth):
        raise DataError("the values contain NaN; drop them before estimating")
    return ThresholdResult(kth, k, k, 1, "topk", inclusive=True)


def _dgc(values: torch.Tensor, k: int, generator: torch.Generator | None) -> ThresholdResult:
    """DGC: sample 1% of coordinates (at least 2/delta), take the smallest of the top
    ceil(sample * delta) sampled magnitudes; exact top-k on the candidates when more than
    1.3k are selected, threshold x0.8 and retry when fewer than 0.8k."""
    _check_k(k, _nonzeros(values))
    flat = values.reshape(-1)
    d = flat.numel()
    density = k / d
    size = min(d, max(math.ceil(0.01 * d), math.ceil(2.0 / density)))
    index = torch.randint(d, (size,), generator=generator, device="cpu").to(flat.device)
    sample = flat[index].abs()
    top = max(1, math.ceil(size * density))
    threshold = float(torch.topk(sample, top, sorted=False).values.amin())
    if not math.isfinite(threshold):  # x0.8 would never bring NaN or Inf down
        raise DataError("the values contain NaN or Inf; drop them before estimating")
    while True:
        candidates = _exceed(flat, threshold, inclusive=True)
        if candidates.numel() > 1.3 * k:
            threshold = float(torch.topk(candidates, k, sorted=False).values.amin())
            return ThresholdResult(threshold, k, k, 1, "dgc", inclusive=True)
        if candidates.numel() >= 0.8 * k:
            return ThresholdResult(threshold, candidates.numel(), k, 1, "dgc", inclusive=True)
        threshold *= 0.8


def _gaussiank(values: torch.Tensor, k: int) -> ThresholdResult:
    """Gaussian-k: eta = mu + Phi^-1(1 - delta/2) sigma of the signed non-zero values;
    x0.5 when fewer than 2k/3 are selected, x1.5 when more than 4k/3, up to 3 times."""
    flat = values.reshape(-1)
    sums, squares = [], []
    for chunk in _chunks(flat):
        sums.append(chunk.sum())
        squares.append(chunk.square().sum())
    n = _nonzeros(flat)
    if n == 0:
        raise DataError("all values are exactly zero: nothing to fit")
    _check_k(k, n)
    mean = float(torch.stack(sums).double().sum()) / n
    var = max(float(torch.stack(squares).double().sum()) / n - mean * mean, 0.0)
    if not math.isfinite(var):
        raise DataError("the values contain NaN or Inf; drop them before estimating")
    threshold = mean + float(ndtri(1.0 - k / n / 2.0)) * math.sqrt(var)
    for adjustment in range(4):
        selected = _count(flat, threshold)
        if adjustment == 3 or 2 * k / 3 <= selected <= 4 * k / 3:
            break
        threshold *= 0.5 if selected < 2 * k / 3 else 1.5
    return ThresholdResult(threshold, selected, k, 1, "gaussiank")


def _redsync(values: torch.Tensor, k: int, max_iterations: int = 40) -> ThresholdResult:
    """RedSync: binary search of t in [0, 1] for eta = mean + t (max - mean) of |x| until
    k < count < 2k. Counts run on a shrinking pool of candidates above the lower bound."""
    flat = values.reshape(-1)
    _check_k(k, _nonzeros(flat))
    sums, maxima = [], []
    for chunk in _chunks(flat):
        a = chunk.abs()
        sums.append(a.sum())
        maxima.append(a.amax())
    mean = float(torch.stack(sums).double().sum()) / flat.numel()
    top = float(torch.stack(maxima).amax())
    if not math.isfinite(mean):
        raise DataError("the values contain NaN or Inf; drop them before estimating")
    low, high = 0.0, 1.0
    pool = flat
    threshold, selected = mean, _count(flat, mean)
    for _ in range(max_iterations):
        t = (low + high) / 2.0
        threshold = mean + t * (top - mean)
        selected = _count(pool, threshold)
        if k < selected < 2 * k:
            break
        if selected >= 2 * k:
            low = t
            if 4 * selected < pool.numel():
                pool = _exceed(pool, threshold)
        else:
            high = t
    return ThresholdResult(threshold, selected, k, 1, "redsync")


def _hard(values: torch.Tensor, k: int, threshold: float | None) -> ThresholdResult:
    if threshold is None or not math.isfinite(threshold) or threshold < 0:
        raise UsageError("the hard threshold needs a finite threshold >= 0")
    return ThresholdResult(
        threshold, _count(values, threshold, inclusive=True), k, 1, "hard", inclusive=True
    )


def _check_k(k: int, nonzeros: int) -> None:
    if nonzeros == 0:
        raise DataError("all values are exactly zero: nothing to select")
    if k > nonzeros:
        raise UsageError(
            f"k = {k} is larger than the {nonzeros} non-zero values; use a smaller ratio"
        )


def target_count(ratio: float, numel: int) -> int:
    """k for a density: ``max(1, round(ratio * numel))``, the rule of
    ``gradstat.analysis.selection.k_for`` (stats may not import the analysis layer)."""
    return max(1, round(ratio * numel))


def estimate_threshold(
    values: torch.Tensor,
    ratio: float,
    estimator: str,
    *,
    stages: int = 3,
    threshold: float | None = None,
    generator: torch.Generator | None = None,
) -> ThresholdResult:
    """Estimate the threshold that keeps about ``k = ratio * values.numel()`` elements.

    ``values`` is the signed flat vector (Gaussian-k needs the sign); every estimator
    thresholds ``|values|``. ``stages`` is SIDCo's stage count M, ``threshold`` the
    ``hard`` estimator's lambda, ``generator`` DGC's sampling generator.
    Raises :class:`UsageError` for an unknown estimator, a ratio outside (0, 1), a stage
    count below 1 or k above the number of non-zeros; :class:`DataError` for an all-zero
    or non-finite vector.
    """
    if estimator not in ESTIMATORS:
        raise UsageError(f"unknown estimator {estimator!r}; choose from {', '.join(ESTIMATORS)}")
    if not (0.0 < ratio < 1.0):
        raise UsageError(f"ratio {ratio} is outside (0, 1)")
    if stages < 1:
        raise UsageError(f"stages must be at least 1, got {stages}")
    if values.numel() == 0:
        raise DataError("no values to threshold (empty vector)")
    k = target_count(ratio, values.numel())
    if estimator in SIDCO_ESTIMATORS:
        return _sidco(values, k, estimator, stages)
    if estimator == "topk":
        return _topk(values, k)
    if estimator == "hard":
        return _hard(values, k, threshold)
    if estimator == "dgc":
        return _dgc(values, k, generator)
    if estimator == "gaussiank":
        return _gaussiank(values, k)
    return _redsync(values, k)


class AdaptiveStages:
    """SIDCo's adaptive stage count, searching in both directions (METHODS.md 2).

    Feed each step's quality q; once ``window`` values are in, their mean decides. Inside
    ``[low, high]`` the stage count stays. Outside, the error ``|ln mean q|`` is recorded
    for the current count and the count moves to a neighbour (M - 1 or M + 1) with a lower
    recorded error, else to an unexplored neighbour (the last direction first), else it
    stays (no neighbour does better). Both directions are needed: an extra stage lowers
    the count on heavy tails and raises it on light ones. The window restarts after a move.
    """

    def __init__(
        self,
        initial: int = 1,
        window: int = 5,
        low: float = 0.8,
        high: float = 1.25,
        max_stages: int = 8,
    ) -> None:
        if not 1 <= initial <= max_stages:
            raise UsageError(f"initial stages {initial} outside 1..{max_stages}")
        if window < 1 or not 0.0 < low <= 1.0 <= high:
            raise UsageError("window must be >= 1 and low <= 1 <= high, low > 0")
        self._stages = initial
        self._max = max_stages
        self._low, self._high = low, high
        self._history: deque[float] = deque(maxlen=window)
        self._errors: dict[int, float] = {}
        self._direction = 1

    @property
    def stages(self) -> int:
        return self._stages

    def update(self, quality: float) -> int:
        """Record the last q; returns the stage count to use next."""
        self._history.append(quality)
        if len(self._history) < (self._history.maxlen or 1):
            return self._stages
        mean = sum(self._history) / len(self._history)
        if self._low <= mean <= self._high:
            return self._stages
        error = abs(math.log(mean)) if mean > 0 else math.inf
        current = self._stages
        self._errors[current] = error
        neighbours = [
            m for m in (current + self._direction, current - self._direction) if 1 <= m <= self._max
        ]
        better = [m for m in neighbours if self._errors.get(m, math.inf) < error]
        unexplored = [m for m in neighbours if m not in self._errors]
        if better:
            chosen = min(better, key=self._errors.__getitem__)
        elif unexplored:
            chosen = unexplored[0]
        else:
            return current
        self._direction = 1 if chosen > current else -1
        self._stages = chosen
        self._history.clear()
        return chosen
