"""``fit``: distribution fits, goodness of fit and threshold estimators over a capture.

For every selected (step, learner, scope) vector the analysis
* counts its exact zeros and NaN/Inf (warned about), which no fit or estimator sees;
* fits each chosen distribution (docs/methods.md 1) to the non-zero values and scores it
  on the magnitudes |g| (normal and Laplace folded, see
  :class:`~gradstat.stats.distributions.Folded`): KS, Anderson-Darling, log-likelihood,
  AIC/BIC, and at each ratio the fitted upper quantile, what it selects and its relative
  error against the empirical quantile (the k-th largest |g|);
* runs the threshold estimators (docs/methods.md 2) at each ratio, SIDCo with each fixed
  stage count or the adaptive rule.

Every answer about the vector comes from its row statistics
(:class:`~gradstat.stats.row_statistics.RowStatistics`, :func:`row_records`):

* moment fits with moment SIDCo stages (the default): the row's bins
  (:class:`~gradstat.stats.histogram.RowHistogram`), whose answers cover every non-zero
  value. The bins the records read are gathered up front in one more pass: the scores'
  (:func:`~gradstat.stats.histogram_fit.score_bins`) and those a sketch of the row reads
  (:meth:`~gradstat.stats.histogram.RowHistogram.sketch`, :meth:`_Row._gather`).
* maximum-likelihood fits or SIDCo stages (``method="mle"``, ``stage_fit="mle"``): the
  exact passes (:class:`~gradstat.stats.passes.RowPasses`); MLE fits and every score
  see a uniform subsample of ``sample`` values.

It streams: a unit (a run of steps, one per process) reads one scope of one learner's
row at a time into a buffer it owns.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from gradstat import defaults
from gradstat.analysis.compute import Compute
from gradstat.analysis.row_workspace import read_block
from gradstat.analysis.selection import Selection, parse_ratios, require_one_kept
from gradstat.errors import DataError, GradstatError, GradstatWarning, UsageError
from gradstat.parallel import Progress, Task, no_progress, planned_workers, run_units, runs
from gradstat.stats import histogram_fit
from gradstat.stats.density import check_k, k_for
from gradstat.stats.distributions import (
    DISTRIBUTIONS,
    METHODS,
    Distribution,
    get_distribution,
)
from gradstat.stats.goodness import information_criteria, ks_ad, quantile_error, subsample
from gradstat.stats.histogram import PLAN_MIN_NUMEL, RowHistogram
from gradstat.stats.passes import RowPasses, compress
from gradstat.stats.row_statistics import RowStatistics
from gradstat.stats.rows import count_nonfinite
from gradstat.stats.sidco import AdaptiveStages, check_choices
from gradstat.stats.thresholds import (
    DEFAULT_ESTIMATORS,
    ESTIMATORS,
    ThresholdResult,
    dgc_threshold,
    estimate_threshold,
    get_estimator,
)
from gradstat.store import Capture, Scope
from gradstat.threads import torch_threads

#: The columns of fit's records, in order.
COLUMNS = (
    "step",
    "learner",
    "scope",
    "kind",
    "dist",
    "method",
    "estimator",
    "params",
    "numel",
    "nonzero",
    "zeros",
    "nonfinite",
    "n_fit",
    "loglik",
    "aic",
    "bic",
    "ks",
    "ad",
    "ratio",
    "stages",
    "adaptive",
    "k",
    "threshold",
    "selected",
    "quality",
    "empirical",
    "quantile_error",
    "error",
)


def parse_dists(spec: str | Sequence[str]) -> list[str]:
    """``all``, one name or a comma-separated list of distribution names."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [name.strip() for name in names if name.strip()]
    if names == ["all"]:
        return list(DISTRIBUTIONS)
    if not names:
        raise UsageError("give at least one distribution")
    for name in names:
        get_distribution(name)
    return list(dict.fromkeys(names))


def parse_stages(spec: str | Sequence[int] | None) -> list[int] | None:
    """``1,2,3`` (fixed stage counts) or ``auto`` (None: the adaptive rule)."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec.strip() == "auto":
            return None
        try:
            stages = [int(part) for part in spec.split(",")]
        except ValueError:
            raise UsageError(f"stages={spec!r}: expected N,M,... or auto") from None
    else:
        stages = [int(s) for s in spec]
    if not stages or any(s < 1 for s in stages):
        raise UsageError(f"stages={spec!r}: stage counts must be >= 1")
    return list(dict.fromkeys(stages))


def parse_estimators(spec: str | Sequence[str]) -> list[str]:
    """A comma-separated list of threshold estimators (empty: none)."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [name.strip() for name in names if name.strip()]
    for name in names:
        get_estimator(name)
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class FitParams:
    """The fit's parameters, parsed and validated (text as on the command line or Python
    values; defaults: :mod:`gradstat.defaults`, as ``gradstat fit``): ``dists``
    (``"all"``, a name or names), ``method`` (moments or mle), ``ratios``, ``stages``
    (stage counts, or ``"auto"``/None for the adaptive rule), ``estimators``,
    ``hard_threshold`` (runs the ``hard`` estimator), ``zeros`` and ``stage_fit`` (SIDCo
    and Gaussian-k: exact zeros excluded, or included as the SIDCo reference does;
    SIDCo's GPD stages by moments or MLE; docs/methods.md 2), ``sample`` (subsample size
    of MLE fits and their scores; None or 0: every value) and ``seed``. Distribution fits
    always exclude zeros."""

    dists: tuple[str, ...] = defaults.FIT_DISTS
    method: str = defaults.FIT_METHOD
    ratios: tuple[float, ...] = defaults.RATIOS
    stages: tuple[int, ...] | None = defaults.FIT_STAGES
    estimators: tuple[str, ...] = DEFAULT_ESTIMATORS
    hard_threshold: float | None = None
    zeros: str = defaults.ZEROS
    stage_fit: str = defaults.STAGE_FIT
    sample: int | None = defaults.FIT_SAMPLE
    seed: int = defaults.SEED

    def __post_init__(self) -> None:
        check_choices(self.zeros, self.stage_fit)
        if self.method not in METHODS:
            choices = ", ".join(METHODS)
            raise UsageError(f"unknown fit method {self.method!r}; choose from {choices}")
        sample = self.sample or None
        if sample is not None and sample < 10:
            raise UsageError(f"sample={sample}: use at least 10 values (or 0 for all)")
        stages = None if self.stages is None else parse_stages(self.stages)
        estimators = parse_estimators(self.estimators)
        if "hard" in estimators and self.hard_threshold is None:
            raise UsageError("the hard estimator needs a threshold (hard_threshold)")
        hard = self.hard_threshold
        if hard is not None and not (math.isfinite(hard) and hard > 0):
            raise UsageError(f"hard threshold {hard}: give a positive magnitude, e.g. 1e-3")
        if self.hard_threshold is not None and "hard" not in estimators:
            estimators.append("hard")
        set_ = object.__setattr__
        set_(self, "dists", tuple(parse_dists(self.dists)))
        set_(self, "ratios", tuple(parse_ratios(self.ratios)))
        set_(self, "stages", None if stages is None else tuple(stages))
        set_(self, "estimators", tuple(estimators))
        set_(self, "sample", sample)

    @property
    def binned(self) -> bool:
        """Whether every answer comes from the row's bins: moment fits and moment SIDCo
        stages (else the exact passes, see the module)."""
        return self.method == "moments" and self.stage_fit == "moments"


def fit(
    cap: Capture,
    selection: Selection | None = None,
    params: FitParams | None = None,
    *,
    compute: Compute | None = None,
    progress: Progress = no_progress,
) -> pd.DataFrame:
    """The fit analysis: one record per (step, learner, scope) and

    * distribution and ratio (``kind`` = ``fit``, ``stages`` = 1): parameters (scipy
      names), scores, the fitted upper quantile as a threshold;
    * estimator, ratio and stage count (``kind`` = ``estimator``).

    ``quality`` = selected / k with k = ratio * numel; the densities fitted are
    k / (non-zeros). A record that could not be computed carries its reason in ``error``.
    Units: runs of steps, one per process (a run reports each step as it ends); one unit
    of every step with adaptive stages (``stages=None``), whose stage counts carry from
    step to step.
    """
    selection = selection or Selection.of(cap)
    params = params or FitParams()
    compute = compute or Compute()
    require_one_kept(selection.scopes(cap), params.ratios)
    steps = selection.steps
    workers = 1 if params.stages is None else planned_workers(cap, selection, compute.jobs)
    units = runs(steps, workers)
    task = Task(fit_unit, str(cap.path), selection, params, parts=None)
    records = pd.DataFrame(run_units(cap, task, units, compute, progress), columns=list(COLUMNS))
    counts = ("n_fit", "stages", "k", "selected")
    records = records.astype(dict.fromkeys(counts, "Int64"))
    if records["error"].notna().all():
        raise DataError(f"nothing could be computed: {records['error'].iloc[0]}")
    return records


def fit_unit(
    cap: Capture,
    selection: Selection,
    params: FitParams,
    compute: Compute,
    steps: Sequence[int],
    *,
    tick: Callable[[], None] = lambda: None,
) -> list[dict]:
    """Records of ``steps``, one scope of one learner's row in memory at a time (read
    into the unit's buffer, then moved to the compute device)."""
    scopes = selection.scopes(cap)
    device = compute.torch_device()
    buffer = np.empty(max(scope.numel for scope in scopes), dtype=np.float32)
    adaptive: dict[tuple, AdaptiveStages] = {}
    records: list[dict] = []
    for step in steps:
        for learner in selection.learners:
            for scope in scopes:
                row = read_block(cap, step, learner, scope, 0, scope.numel, buffer)
                where = (step, learner, scope.name)
                values = torch.from_numpy(row).to(device)
                records += row_records(params, where, values, adaptive)
        tick()
    return records


def row_records(
    params: FitParams,
    where: tuple[int, int, str],
    values: torch.Tensor,
    adaptive: dict[tuple, AdaptiveStages],
    statistics: Callable[[torch.Tensor], RowStatistics] | None = None,
) -> list[dict]:
    """The records of one ``(step, learner, scope)`` vector ``values`` (the module).

    ``adaptive``: the adaptive stage counts of a run of steps, learned as the records
    come; ``statistics``: how the row statistics are made (default:
    :class:`RowHistogram` when ``params.binned``, else :class:`RowPasses`), for a
    caller that keeps them to look at (its reads: ``RowHistogram.gathers``)."""
    step, learner, scope = where
    make = statistics or (RowHistogram if params.binned else RowPasses)
    with torch_threads(1):  # vectors of a few thousand bins or samples: one thread
        stats = make(values)
        binned = isinstance(stats, RowHistogram)  # the bins have counted them
        nonfinite = stats.bins.nonfinite if binned else count_nonfinite(values)
        if nonfinite:
            message = f"step {step}, learner {learner}, scope {scope}: {nonfinite} NaN/Inf"
            warnings.warn(f"{message} values excluded", GradstatWarning, stacklevel=2)
            values = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
            stats = make(values)
        base = {
            "step": step,
            "learner": learner,
            "scope": scope,
            "numel": values.numel(),
            "nonzero": stats.nonzeros,
            "zeros": values.numel() - stats.nonzeros - nonfinite,
            "nonfinite": nonfinite,
        }
        return _Row(params, base, values, stats, adaptive).records()


class _Row:
    """The records of one vector from its row statistics (:func:`row_records`)."""

    def __init__(
        self,
        params: FitParams,
        base: dict,
        values: torch.Tensor,
        stats: RowStatistics,
        adaptive: dict[tuple, AdaptiveStages],
    ) -> None:
        self.params, self.base, self.values, self.stats = params, base, values, stats
        self.adaptive = adaptive
        self.ks = {ratio: k_for(ratio, values.numel()) for ratio in params.ratios}
        # DGC's 1% samples, drawn once for the sketch and the records (random reads are
        # its slow part), in the order DGC runs: each ratio, from a generator seeded by
        # the step, the same in every run
        generator = torch.Generator().manual_seed(params.seed + int(base["step"]))
        self.sampled = {
            ratio: dgc_threshold(values, k, generator)
            for ratio, k in self.ks.items()
            if "dgc" in params.estimators
        }
        if isinstance(stats, RowHistogram):
            self.fits: _BinnedFits | _SampledFits = _BinnedFits(stats)
        else:
            self.fits = _SampledFits(stats, values, params.sample, params.seed)

    def records(self) -> list[dict]:
        fitted: dict[str, Distribution | GradstatError] = {}
        for name in self.params.dists:  # each fit, or why there is none
            try:
                fitted[name] = self.fits.fit(get_distribution(name), self.params.method)
            except GradstatError as exc:
                fitted[name] = exc
        dists = [dist for dist in fitted.values() if isinstance(dist, Distribution)]
        if isinstance(self.stats, RowHistogram) and self.stats.numel >= PLAN_MIN_NUMEL:
            self._gather(self.stats, dists)
        empirical = self._empirical(self.stats)
        rows = []
        for name, dist in fitted.items():
            fit_base = {**self.base, "kind": "fit", "dist": name, "method": self.params.method}
            fit_base["stages"] = 1
            try:
                if isinstance(dist, GradstatError):
                    raise dist
                fit_base.update(params=dist.params, **self.fits.scores(dist))
            except GradstatError as exc:
                rows += [_row(fit_base, ratio=r, error=str(exc)) for r in self.params.ratios]
                continue
            rows += self._quantile_rows(fit_base, dist, empirical)
        for row_base, result in self._estimates(self.stats, empirical):
            if isinstance(result, GradstatError):
                rows.append(_row(row_base, error=str(result)))
                continue
            if row_base["adaptive"]:
                self._rule(row_base["estimator"], row_base["ratio"]).update(result.quality)
            rows.append(_result_row(row_base, result, empirical[row_base["ratio"]]))
        return rows

    def _gather(self, hist: RowHistogram, dists: list[Distribution]) -> None:
        """Gather in one pass the bins the records will read: the scores' (known from the
        fits) and those a sketch of the row reads for the k-th largest values, the
        fitted quantiles and every estimator (module docstring)."""
        sketch = hist.sketch()
        empirical = self._empirical(sketch)
        for dist in dists:
            for ratio, k in self.ks.items():
                if not isinstance(empirical[ratio], str):
                    sketch.count(dist.magnitude_isf(k / hist.nonzeros))
            sketch.touched.update(int(j) for j in histogram_fit.score_bins(dist, hist))
        for _ in self._estimates(sketch, empirical):
            pass
        hist.planned(sketch)

    def _empirical(self, stats: RowStatistics) -> dict[float, float | str]:
        """The k-th largest |g| at each ratio (what ``topk`` selects), or where k exceeds
        the non-zeros, why there is none."""
        empirical: dict[float, float | str] = {}
        for ratio, k in self.ks.items():
            try:
                check_k(k, stats.nonzeros)
            except GradstatError as exc:
                empirical[ratio] = str(exc)
            else:
                empirical[ratio] = stats.kth_largest(k)
        return empirical

    def _quantile_rows(self, fit_base: dict, dist: Distribution, empirical: dict) -> list[dict]:
        """A fitted distribution's upper quantile at each ratio: its count and errors."""
        rows = []
        for ratio, k in self.ks.items():
            if isinstance(empirical[ratio], str):
                rows.append(_row(fit_base, ratio=ratio, k=k, error=empirical[ratio]))
                continue
            threshold = dist.magnitude_isf(k / self.stats.nonzeros)
            result = ThresholdResult(threshold, self.stats.count(threshold), k)
            rows.append(_result_row({**fit_base, "ratio": ratio}, result, empirical[ratio]))
        return rows

    def _rule(self, estimator: str, ratio: float) -> AdaptiveStages:
        """The adaptive stage count of this learner, scope, estimator and ratio."""
        key = (self.base["learner"], self.base["scope"], estimator, ratio)
        return self.adaptive.setdefault(key, AdaptiveStages())

    def _estimates(
        self, stats: RowStatistics, empirical: dict
    ) -> Iterator[tuple[dict, ThresholdResult | GradstatError]]:
        """Every estimator at every ratio and stage count (the adaptive rule's current
        one), on ``stats``: its record's base and its result, or the error that stopped
        it."""
        for estimator in self.params.estimators:
            staged = ESTIMATORS[estimator].staged
            for ratio in self.params.ratios:
                adaptive = staged and self.params.stages is None
                if adaptive:
                    counts = [self._rule(estimator, ratio).stages]
                else:
                    counts = list(self.params.stages) if staged and self.params.stages else [1]
                for stages in counts:
                    row_base = {
                        **self.base,
                        "kind": "estimator",
                        "dist": ESTIMATORS[estimator].dist,
                        "estimator": estimator,
                        "ratio": ratio,
                        "stages": stages,
                        "adaptive": adaptive,
                    }
                    try:
                        result = self._estimate(stats, ratio, estimator, stages, empirical)
                    except GradstatError as exc:
                        yield row_base, exc
                    else:
                        yield row_base, result

    def _estimate(
        self,
        stats: RowStatistics,
        ratio: float,
        estimator: str,
        stages: int,
        empirical: dict,
    ) -> ThresholdResult:
        """One estimator's threshold; ``topk`` is the empirical quantile already found."""
        if estimator == "topk" and not isinstance(empirical[ratio], str):
            k = self.ks[ratio]
            return ThresholdResult(empirical[ratio], k, k, 1, "topk", inclusive=True)
        return estimate_threshold(
            self.values,
            ratio,
            estimator,
            stages=stages,
            threshold=self.params.hard_threshold,
            zeros=self.params.zeros,
            stage_fit=self.params.stage_fit,
            shared=stats,
            sampled=self.sampled.get(ratio) if estimator == "dgc" else None,
        )


class _BinnedFits:
    """Moment fits and scores on every non-zero value, from the row's bins
    (:mod:`gradstat.stats.histogram_fit`)."""

    def __init__(self, hist: RowHistogram) -> None:
        self.hist = hist

    def fit(self, cls: type[Distribution], method: str) -> Distribution:
        return histogram_fit.fit_moments(cls, self.hist)

    def scores(self, dist: Distribution) -> dict:
        loglik = histogram_fit.loglik(dist, self.hist)
        aic, bic = information_criteria(loglik, dist.n_params, self.hist.nonzeros)
        return {
            "n_fit": self.hist.nonzeros,
            "loglik": loglik,
            "aic": aic,
            "bic": bic,
            "ks": histogram_fit.ks(dist, self.hist),
            "ad": histogram_fit.anderson_darling(dist, self.hist),
        }


class _SampledFits:
    """Fits of the non-zero values (signed for signed models, else magnitudes): moment
    fits of all of them, MLE fits of a uniform subsample of ``sample`` (every value:
    None); scores on that subsample of the magnitudes (the signed sample is at the same
    positions: :func:`subsample` draws them from the count and the seed alone)."""

    def __init__(
        self, passes: RowPasses, values: torch.Tensor, sample: int | None, seed: int
    ) -> None:
        self.passes, self.values, self.sample, self.seed = passes, values.reshape(-1), sample, seed
        self._signed: torch.Tensor | None = None
        self._sorted: torch.Tensor | None = None

    def _nonzero(self, signed: bool) -> torch.Tensor:
        if not signed:
            return self.passes.magnitudes()
        if self._signed is None:
            self._signed = compress(self.values, self.values != 0)
        return self._signed

    def fit(self, cls: type[Distribution], method: str) -> Distribution:
        data = self._nonzero(cls.signed)
        if method == "mle":
            data = subsample(data, self.sample, self.seed)
        return cls.fit(data, method)

    def scores(self, dist: Distribution) -> dict:
        if self._sorted is None:  # sorted as float32, whose order the widening keeps
            magnitudes = subsample(self.passes.magnitudes(), self.sample, self.seed)
            self._sorted = torch.sort(magnitudes).values.double()
        x = self._sorted
        magnitudes = dist.magnitudes()
        loglik = magnitudes.loglik(x)
        aic, bic = information_criteria(loglik, dist.n_params, x.numel())
        ks, ad = ks_ad(x, magnitudes, presorted=True)
        return {"n_fit": x.numel(), "loglik": loglik, "aic": aic, "bic": bic, "ks": ks, "ad": ad}


def _result_row(base: dict, result: ThresholdResult, reference: float | str) -> dict:
    """A record of a threshold (an estimator's, or a fitted upper quantile's) and what it
    selects, against the empirical quantile ``reference`` (a string: why there is none)."""
    known = not isinstance(reference, str)
    return _row(
        base,
        stages=result.stages,
        k=result.k,
        threshold=result.threshold,
        selected=result.selected,
        quality=result.quality,
        empirical=reference if known else None,
        quantile_error=quantile_error(result.threshold, reference) if known else math.nan,
    )


def _row(base: dict, **values) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(base)
    row.update(values)
    return row


def rank_distributions(records: pd.DataFrame) -> pd.DataFrame:
    """Distributions ranked by median KS over (step, learner, scope), with median AD,
    AIC and tail-quantile error at each ratio."""
    fits = records[(records["kind"] == "fit") & records["error"].isna()]
    if fits.empty:
        return pd.DataFrame(columns=["rank", "dist", "ks", "ad", "aic"])
    per_fit = fits.drop_duplicates(["step", "learner", "scope", "dist"])
    ranking = per_fit.groupby("dist", sort=False)[["ks", "ad", "aic"]].median().sort_values("ks")
    ranking.insert(0, "rank", np.arange(1, len(ranking) + 1))
    errors = fits.pivot_table(
        index="dist", columns="ratio", values="quantile_error", aggfunc="median"
    )
    errors = errors[sorted(errors.columns, reverse=True)]
    errors.columns = [f"qerr@{r:g}" for r in errors.columns]
    ranking = ranking.join(errors).reset_index()
    return ranking[["rank", "dist", *ranking.columns.drop(["rank", "dist"])]]


def quality_summary(records: pd.DataFrame) -> pd.DataFrame:
    """Median, min and max q per (estimator, ratio, stages); adaptive runs as ``auto``,
    fitted distributions' own quantiles as estimator ``fit:<dist>``."""
    done = records[records["error"].isna()].copy()
    if done.empty:
        return pd.DataFrame(columns=["estimator", "ratio", "stages", "q median"])
    done["estimator"] = done["estimator"].where(done["kind"] == "estimator", "fit:" + done["dist"])
    done["stages"] = [
        "auto" if adaptive is True else str(int(s))
        for adaptive, s in zip(done["adaptive"], done["stages"], strict=True)
    ]
    grouped = done.groupby(["estimator", "ratio", "stages"], sort=False)["quality"]
    summary = grouped.agg(["median", "min", "max", "count"]).reset_index()
    summary.columns = ["estimator", "ratio", "stages", "q median", "q min", "q max", "n"]
    return summary.sort_values(["ratio", "estimator", "stages"], ascending=[False, True, True])


def magnitude_sample(
    cap: Capture, step: int, learner: int, scope: Scope, size: int | None = 200_000, seed: int = 0
) -> np.ndarray:
    """Non-zero finite |g| of one (step, learner, scope), subsampled to ``size``: what
    the fit plot draws its histogram, Q-Q and CCDF from."""
    row = read_block(cap, step, learner, scope, 0, scope.numel, np.empty(scope.numel, np.float32))
    magnitudes = np.abs(row)
    magnitudes = magnitudes[(magnitudes > 0) & np.isfinite(magnitudes)]
    if magnitudes.size == 0:
        raise DataError(f"step {step}, learner {learner}, scope {scope.name}: all values are zero")
    return subsample(torch.from_numpy(magnitudes), size, seed).double().numpy()
