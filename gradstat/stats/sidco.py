"""SIDCo's multi-stage threshold (Abdelmoniem et al. 2021, arXiv 2101.10761) and its
adaptive stage count (docs/methods.md section 2).

Stage 1 fits a sparsity-inducing distribution (exponential, GPD or gamma) to every
magnitude and takes its upper quantile at density 0.25; each later stage fits the
excesses of the previous stage's exceedances over their minimum (exponential or GPD)
at an equal share of the remaining density, so the densities multiply to k / n.

Two choices, each with the SIDCo authors' code (sands-lab/SIDCo, ``compression.py``) as
a reference:

* ``zeros``: ``exclude`` (default) fits the non-zero magnitudes at density k / nnz, as
  a sparsifier of a vector with dead units would want: exact zeros are not part of the
  gradient's distribution and are never selected. ``include`` is the reference's rule:
  stage 1 fits every element at density k / d, and its gamma's mean log takes
  ln(|x| / ||x||_2 + eps) with eps = 2.2e-16, so each zero adds ln(eps ||x||_2).
  Later stages only see exceedances (never zero), so the choice only moves stage 1.
* ``stage_fit``: ``moments`` (default, the reference) fits every GPD stage by moments;
  ``mle`` by maximum likelihood (:func:`gradstat.stats.mle.gpd`) on an evenly strided
  subsample of at most ~32,768 values (stage 1: the magnitudes; later stages: the
  excesses), each later stage warm-started from the one before by threshold stability
  (the excesses of GPD(c, s) over u are GPD(c, s + c u)). Moment fits of a GPD are
  biased on heavy tails (the variance does not exist for c >= 0.5); the MLE is not.
  Exponential and gamma stages are the same either way (the exponential's MLE is its
  mean; SIDCo-GP's gamma stays the reference's closed form).
"""

from __future__ import annotations

import math
import sys
from collections import deque
from dataclasses import dataclass

import torch

from gradstat.errors import UsageError
from gradstat.stats import mle
from gradstat.stats.density import check_k
from gradstat.stats.distributions import Exponential, Gamma, GenPareto
from gradstat.stats.passes import RowPasses
from gradstat.stats.row_statistics import ExceedanceSums, MagnitudeSums, RowStatistics

ZEROS: tuple[str, ...] = ("exclude", "include")
STAGE_FITS: tuple[str, ...] = ("moments", "mle")
#: SIDCo's first-stage density when more than one stage is used.
FIRST_STAGE_DENSITY = 0.25
#: Largest subsample of a stage's excesses that its GPD MLE sees.
MLE_SAMPLE = 1 << 15
#: The reference adds this to every normalised magnitude inside its gamma's log.
_REFERENCE_EPS = sys.float_info.epsilon


@dataclass(frozen=True)
class Moments:
    """Count, mean, variance (ddof 0) and mean log of the magnitudes a stage fits."""

    n: int
    mean: float
    var: float
    mean_log: float = math.nan


@dataclass(frozen=True)
class Stages:
    """What SIDCo chose: the final threshold, its count, and each stage's density and
    threshold (fewer than asked when a stage had under 2 exceedances to fit)."""

    threshold: float
    selected: int
    densities: tuple[float, ...]
    thresholds: tuple[float, ...]


def check_choices(zeros: str, stage_fit: str) -> None:
    """Raise :class:`UsageError` for a ``zeros`` or ``stage_fit`` outside its choices."""
    if zeros not in ZEROS:
        raise UsageError(f"--zeros {zeros!r}: choose from {', '.join(ZEROS)}")
    if stage_fit not in STAGE_FITS:
        raise UsageError(f"--stage-fit {stage_fit!r}: choose from {', '.join(STAGE_FITS)}")


def first_stage_moments(sums: MagnitudeSums, zeros: str) -> Moments:
    """Moments of stage 1's magnitudes: the non-zeros, or every element (``include``)."""
    n = sums.nonzeros if zeros == "exclude" else sums.numel
    mean = sums.total / n
    var = max(sums.squares / n - mean * mean, 0.0)
    mean_log = math.nan
    if not math.isnan(sums.log_sum):
        log_sum = sums.log_sum
        if zeros == "include":
            zero_log = math.log(_REFERENCE_EPS * math.sqrt(sums.squares))
            log_sum += (sums.numel - sums.nonzeros) * zero_log
        mean_log = log_sum / n
    return Moments(n, mean, var, mean_log)


def excess_moments(above: ExceedanceSums) -> Moments:
    """Mean and variance of the excesses over their minimum (a later stage), from float32
    sums of the exceedances themselves: no shifted copy. The spread of a tail is
    comparable to its level, so E[y^2] - E[y]^2 keeps ~6 digits."""
    mean = above.total / above.n
    var = max(above.squares / above.n - mean * mean, 0.0)
    return Moments(above.n, mean - above.minimum, var)


# --- closed-form upper quantiles of SIDCo's fits ------------------------------------------
def exponential_quantile(moments: Moments, density: float) -> float:
    """Exponential MLE beta = mean; eta = -beta ln(density)."""
    return float(Exponential.from_mean(moments.mean).isf(density))


def gpd_quantile(moments: Moments, density: float) -> float:
    """GPD by moments; eta = (sigma/xi)(density^-xi - 1), -sigma ln(density) as xi -> 0.
    Values without spread (var = 0) give their common level."""
    if moments.var <= 0.0:
        return moments.mean
    return float(GenPareto.from_moments(moments.mean, moments.var).isf(density))


def gamma_quantile(moments: Moments, density: float) -> float:
    """SIDCo's closed-form gamma; eta = scale * Q^-1(a, density) (upper regularised
    incomplete gamma inverse). Values without spread give their common level."""
    if not math.log(moments.mean) - moments.mean_log > 0.0:
        return moments.mean
    return float(Gamma.from_log_moments(moments.mean, moments.mean_log).isf(density))


QUANTILES = {"exp": exponential_quantile, "gpd": gpd_quantile, "gamma": gamma_quantile}


def stage_densities(density: float, stages: int) -> tuple[float, ...]:
    """SIDCo's per-stage densities: 0.25 first (when density < 0.25 and stages > 1), then
    equal shares ``(density / 0.25)^(1/(stages-1))``; they multiply to ``density``."""
    if stages == 1 or density >= FIRST_STAGE_DENSITY:
        return (density,)
    per = (density / FIRST_STAGE_DENSITY) ** (1.0 / (stages - 1))
    return (FIRST_STAGE_DENSITY,) + (per,) * (stages - 1)


def _strided(values: torch.Tensor) -> torch.Tensor:
    """At most about MLE_SAMPLE values, evenly strided (spread over every layer)."""
    return values.reshape(-1)[:: max(1, values.numel() // MLE_SAMPLE)]


class _GpdMle:
    """GPD stages by maximum likelihood, each warm-started from the one before."""

    def __init__(self) -> None:
        self._fit: tuple[float, float] | None = None  # (c, scale) of the last stage
        self._base = 0.0  # the minimum its excesses were measured from

    def first(self, values: torch.Tensor, density: float, zeros: str, moments: Moments) -> float:
        """Stage 1: the GPD MLE of a strided subsample of every magnitude (the moments
        fit when the subsample holds fewer than 2 non-zeros)."""
        sample = _strided(values).abs().double()
        if zeros == "exclude":
            sample = sample[sample > 0]
        if sample.numel() < 2:
            return gpd_quantile(moments, density)
        return self.threshold(sample, 0.0, density)

    def threshold(self, exceedances: torch.Tensor, minimum: float, density: float) -> float:
        """A later stage: minimum + the fitted GPD's upper quantile of the excesses."""
        excesses = (_strided(exceedances).double() - minimum).numpy()
        if excesses.size < 2 or not float(excesses.max()) > 0.0:
            return minimum + float(excesses.mean())  # no spread: their common level
        start = None
        if self._fit is not None:
            c, scale = self._fit
            start = (c, max(scale + c * (minimum - self._base), 1e-3 * scale))
        c, scale = mle.gpd(excesses, start)
        self._fit, self._base = (c, scale), minimum
        return minimum + float(GenPareto(c=c, loc=0.0, scale=scale).isf(density))


def sidco(
    values: torch.Tensor,
    k: int,
    *,
    first: str,
    later: str,
    stages: int,
    zeros: str = "exclude",
    stage_fit: str = "moments",
    shared: RowStatistics | None = None,
) -> Stages:
    """SIDCo's threshold for ``k`` of the magnitudes of ``values`` (see the module
    docstring): ``first`` and ``later`` name the stage fits (exp, gpd, gamma);
    ``shared``: the row statistics of ``values`` kept from earlier calls (``fit`` runs every
    SIDCo variant on a row with one: stage 1 sits at density 0.25 whatever the target
    when there is more than one stage, so its exceedances serve every such call)."""
    check_choices(zeros, stage_fit)
    passes = shared or RowPasses(values)
    sums = passes.sums(log=first == "gamma")
    check_k(k, sums.nonzeros)
    moments = first_stage_moments(sums, zeros)
    densities = stage_densities(k / moments.n, stages)
    mle_stages = _GpdMle() if stage_fit == "mle" and later == "gpd" else None
    if mle_stages is not None and first == "gpd":
        eta = mle_stages.first(values, densities[0], zeros, moments)
    else:
        eta = QUANTILES[first](moments, densities[0])
    thresholds = [eta]
    floor = None  # each stage fits the |x| above the level before: None, the full vector
    for density in densities[1:]:
        floor = _level(eta, floor)
        above = passes.exceedance_sums(floor)  # the last stage's exceedances above eta
        if above.n < 2:
            break  # nothing left to fit: keep the previous stage's threshold
        if mle_stages is not None:
            eta = mle_stages.threshold(passes.exceed(floor), above.minimum, density)
        else:
            eta = above.minimum + QUANTILES[later](excess_moments(above), density)
        thresholds.append(eta)
    used = len(thresholds)
    selected = passes.count(_level(eta, floor))
    return Stages(eta, selected, densities[:used], tuple(thresholds))


def _level(eta: float, floor: float | None) -> float:
    """The level whose exceedances are the last stage's exceedances above ``eta``:
    {|x| > floor} and then > eta is {|x| > max(eta, floor)} (NaN stays NaN)."""
    return floor if floor is not None and eta < floor else eta


class AdaptiveStages:
    """SIDCo's adaptive stage count, searching in both directions (docs/methods.md 2).

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
