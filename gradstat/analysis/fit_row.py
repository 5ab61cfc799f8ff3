"""``fit``'s records of one (step, learner, scope) vector: distribution fits, their
scores and the threshold estimators (the analysis around them: :mod:`gradstat.analysis.fit`).

Moment fits (the default) answer everything from one :class:`RowHistogram` of the row: the
moments of every non-zero value, the fitted quantiles' exact counts, the k-th largest |g|,
the estimators' counts and sums, the log-likelihood, KS and Anderson-Darling of the whole
row (:mod:`gradstat.stats.histogram_fit`). Maximum-likelihood fits (``method="mle"`` or
``stage_fit="mle"``) keep the row's magnitudes and passes over them
(:class:`RowPasses`), and fit and score a subsample of ``sample`` values.
"""

from __future__ import annotations

import math
import warnings
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from gradstat.analysis.selection import k_for
from gradstat.errors import GradstatError, GradstatWarning
from gradstat.stats import histogram_fit
from gradstat.stats.distributions import Distribution, SplitValues, get_distribution, split_values
from gradstat.stats.goodness import information_criteria, ks_ad, quantile_error, subsample
from gradstat.stats.histogram import RowHistogram
from gradstat.stats.passes import RowPasses
from gradstat.stats.sidco import FIRST_STAGE_DENSITY, AdaptiveStages, first_stage_level
from gradstat.stats.thresholds import ESTIMATORS, ThresholdResult, estimate_threshold
from gradstat.stats.topk_sets import kth_largest
from gradstat.threads import torch_threads

if TYPE_CHECKING:
    from gradstat.analysis.fit import FitParams
    from gradstat.store import Scope

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


def _estimator_row(base: dict, result: ThresholdResult, reference: float | str) -> dict:
    """An estimator's record: its result against the empirical quantile ``reference``
    (a string: why there is none)."""
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


class _Scorer:
    """Fits and scores distributions on one (step, learner, scope) vector."""

    def __init__(self, split: SplitValues, sample: int | None, seed: int):
        self.split = split
        self.sample = sample
        self.seed = seed
        self._sorted: torch.Tensor | None = None
        self._signed_sample: torch.Tensor | None = None
        self._magnitude_sample: torch.Tensor | None = None

    def signed_sample(self) -> torch.Tensor:
        """The subsample of the signed values (the magnitude sample's positions)."""
        if self._signed_sample is None:
            self._signed_sample = subsample(self.split.signed, self.sample, self.seed)
        return self._signed_sample

    def magnitude_sample(self) -> torch.Tensor:
        """The subsample of the magnitudes: |x| of :meth:`signed_sample`, drawn from
        the magnitudes themselves (the same positions: ``subsample`` draws them from the
        count and the seed alone), so that magnitude fits never compact signed values."""
        if self._magnitude_sample is None:
            self._magnitude_sample = subsample(self.split.magnitudes, self.sample, self.seed)
        return self._magnitude_sample

    def sorted_magnitudes(self) -> torch.Tensor:
        """The sample's |x| ascending, as float64 (sorted as float32, whose order the
        exact widening keeps: numpy sorts 1M float32 in a third of torch's float64 time)."""
        if self._sorted is None:
            magnitudes = self.magnitude_sample()
            if magnitudes.device.type == "cpu":
                ordered = torch.from_numpy(np.sort(magnitudes.numpy()))
            else:
                ordered = torch.sort(magnitudes).values
            self._sorted = ordered.double()
        return self._sorted

    def fit(self, cls: type[Distribution], method: str) -> Distribution:
        data = self.split.signed if cls.signed else self.split.magnitudes
        if method == "mle":
            data = self.signed_sample() if cls.signed else self.magnitude_sample()
        return cls.fit(data, method)

    def scores(self, dist: Distribution) -> dict:
        magnitudes = dist.magnitudes()
        x = self.sorted_magnitudes()
        loglik = magnitudes.loglik(x)
        aic, bic = information_criteria(loglik, dist.n_params, x.numel())
        ks, ad = ks_ad(x, magnitudes, presorted=True)
        return {
            "n_fit": x.numel(),
            "loglik": loglik,
            "aic": aic,
            "bic": bic,
            "ks": ks,
            "ad": ad,
        }


class _Fitter:
    """Fits, scores and estimators for one (step, learner, scope) vector at a time; keeps
    the adaptive stage counts of a run of steps."""

    def __init__(self, params: FitParams) -> None:
        self.params = params
        self.dists = params.dists
        self.method = params.method
        self.ratios = params.ratios
        self.stages = params.stages
        self.estimators = params.estimators
        self.hard_threshold = params.hard_threshold
        self.sample = params.sample
        self.seed = params.seed
        self._adaptive: dict[tuple, AdaptiveStages] = {}
        #: moment fits and moment SIDCo stages: everything from the row's bins
        self.binned = params.method == "moments" and params.stage_fit == "moments"

    def one(
        self,
        step: int,
        learner: int,
        scope: Scope,
        values: torch.Tensor,
        magnitudes: torch.Tensor | None = None,
    ) -> list[dict]:
        """The records of one vector; ``magnitudes``: a buffer for its |x|, reused from
        row to row (:func:`split_values`; the binned path needs none)."""
        if self.binned:
            return self._binned(step, learner, scope, values)
        split = split_values(values, out=magnitudes)
        where = f"step {step}, learner {learner}, scope {scope.name}"
        if split.nonfinite:
            warnings.warn(
                f"{where}: {split.nonfinite} NaN/Inf values excluded", GradstatWarning, stacklevel=2
            )
            values = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
        base = {
            "step": step,
            "learner": learner,
            "scope": scope.name,
            "numel": values.numel(),
            "nonzero": split.count,
            "zeros": split.zeros,
            "nonfinite": split.nonfinite,
        }
        # every count of this row, shared; numpy's loops: a fit never starts numba, whose
        # 0.7 s start pays back after about 10 rows of 32M values (its loops save 5-8%) and
        # whose ~100 MB would leave fit's peak RSS at 16 x 32M about 30 MB under its target
        passes = RowPasses(values, split.magnitudes, compiled=False)
        self._share_first_stages(passes, split.count)
        empirical = self._empirical(values, split, passes)
        rows = self._fits(base, values, split, empirical, passes)
        learned: list[tuple] = []
        rows += self._estimators(base, values, empirical, passes, learned)
        self._learn(learned)
        return rows

    def _binned(self, step: int, learner: int, scope: Scope, values: torch.Tensor) -> list[dict]:
        """The records of one vector from its :class:`RowHistogram` (see the module), with
        one torch thread: its torch work is on vectors of a few thousand bin edges, where
        a second thread costs more than it saves (on a busy 2-core machine a log1p of 6k
        values took 13-31 ms with two threads, 0.1 ms with one)."""
        with torch_threads(1):
            return self._binned_records(step, learner, scope, values)

    def _binned_records(
        self, step: int, learner: int, scope: Scope, values: torch.Tensor
    ) -> list[dict]:
        hist = RowHistogram(values)
        nonfinite = hist.bins.nonfinite
        if nonfinite:
            where = f"step {step}, learner {learner}, scope {scope.name}"
            warnings.warn(
                f"{where}: {nonfinite} NaN/Inf values excluded", GradstatWarning, stacklevel=3
            )
            values = torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0)
            hist = RowHistogram(values)
        base = {
            "step": step,
            "learner": learner,
            "scope": scope.name,
            "numel": values.numel(),
            "nonzero": hist.nonzeros,
            "zeros": hist.bins.zeros - nonfinite,
            "nonfinite": nonfinite,
        }
        if not hist.plans:
            rows, learned = self._binned_rows(base, values, hist)
        else:
            with hist.tentative() as missed:  # exact where the bins read so far suffice
                rows, learned = self._binned_rows(base, values, hist)
            if missed:  # those bins are read now: the records again, exactly
                rows, learned = self._binned_rows(base, values, hist)
        self._learn(learned)
        return rows

    def _binned_rows(
        self, base: dict, values: torch.Tensor, hist: RowHistogram
    ) -> tuple[list[dict], list[tuple]]:
        """The records from ``hist``, and the (adaptive key, quality) pairs the adaptive
        stage counts are to learn from (:meth:`_estimators`)."""
        empirical: dict[float, float | str] = {}
        for ratio in self.ratios:
            k = k_for(ratio, values.numel())
            if k > hist.nonzeros:  # the topk estimator's error message
                try:
                    estimate_threshold(values, ratio, "topk", shared=hist)
                except GradstatError as exc:
                    empirical[ratio] = str(exc)
            else:
                empirical[ratio] = hist.kth_largest(k)
        rows = []
        for name in self.dists:
            fit_base = {**base, "kind": "fit", "dist": name, "method": self.method, "stages": 1}
            try:
                dist = histogram_fit.fit_moments(get_distribution(name), hist)
                scores = self._binned_scores(dist, hist)
            except GradstatError as exc:
                rows += [_row(fit_base, ratio=r, error=str(exc)) for r in self.ratios]
                continue
            fit_base.update(params=dist.params, **scores)
            rows += self._quantile_rows(fit_base, dist, empirical, hist, hist.nonzeros)
        learned: list[tuple] = []
        rows += self._estimators(base, values, empirical, hist, learned)
        return rows, learned

    @staticmethod
    def _binned_scores(dist: Distribution, hist: RowHistogram) -> dict:
        loglik = histogram_fit.loglik(dist, hist)
        aic, bic = information_criteria(loglik, dist.n_params, hist.nonzeros)
        return {
            "n_fit": hist.nonzeros,
            "loglik": loglik,
            "aic": aic,
            "bic": bic,
            "ks": histogram_fit.ks(dist, hist),
            "ad": histogram_fit.anderson_darling(dist, hist),
        }

    def _quantile_rows(
        self, fit_base: dict, dist: Distribution, empirical: dict, passes, nonzeros: int
    ) -> list[dict]:
        """A fitted distribution's upper quantile at each ratio: its count and errors."""
        rows = []
        numel = fit_base["numel"]
        for ratio in self.ratios:
            k = k_for(ratio, numel)
            if isinstance(empirical[ratio], str):
                rows.append(_row(fit_base, ratio=ratio, k=k, error=empirical[ratio]))
                continue
            threshold = dist.magnitude_isf(k / nonzeros)
            selected = passes.count(threshold)
            rows.append(
                _row(
                    fit_base,
                    ratio=ratio,
                    k=k,
                    threshold=threshold,
                    selected=selected,
                    quality=selected / k,
                    empirical=empirical[ratio],
                    quantile_error=quantile_error(threshold, empirical[ratio]),
                )
            )
        return rows

    def _share_first_stages(self, passes: RowPasses, nonzeros: int) -> None:
        """Take the stage-1 exceedances of every SIDCo variant to come, lowest level first,
        before anything else cuts a set from the row: the row is cut once, each other
        variant's set and the top-k candidates (about 1.5 k of the largest) from that
        quarter of it, not from the whole row each (a row of 32M values: three
        compactions of the row became one; their sums are kept for the runs, the sets
        themselves may be dropped before the last variant runs). The records stay the
        same: a set is the same whichever kept set it is cut from. Errors are left to
        the estimators, which report them."""
        if self.stages is None or max(self.stages) < 2:
            return  # no fixed run of more than one stage
        n = nonzeros if self.params.zeros == "exclude" else passes.numel
        densities = [k_for(ratio, passes.numel) / max(n, 1) for ratio in self.ratios]
        if n == 0 or min(densities) >= FIRST_STAGE_DENSITY:
            return  # every run is a single stage
        families = {ESTIMATORS[name].first_stage for name in self.estimators} - {None}
        if self.params.stage_fit == "mle":
            families.discard("gpd")  # its stage 1 is a maximum-likelihood fit instead
        try:
            levels = [first_stage_level(passes, family, self.params.zeros) for family in families]
        except GradstatError:
            return
        if levels and min(levels) > 0:
            for level in sorted(set(levels)):
                passes.exceedance_sums(level)

    def _empirical(
        self, values: torch.Tensor, split: SplitValues, passes: RowPasses
    ) -> dict[float, float | str]:
        """The k-th largest |g| at each ratio (what ``topk`` selects), from one sort of
        candidates for every ratio (``kth_largest``); where k exceeds the non-zeros, the
        ``topk`` estimator's error message."""
        empirical: dict[float, float | str] = {}
        ks = {ratio: k_for(ratio, values.numel()) for ratio in self.ratios}
        for ratio, k in ks.items():
            if k > split.count:
                try:
                    estimate_threshold(values, ratio, "topk")
                except GradstatError as exc:
                    empirical[ratio] = str(exc)
        computable = [r for r in self.ratios if r not in empirical]
        if computable:  # k <= non-zeros: the k-th largest |g| is a non-zero one
            at_least = partial(passes.exceed, inclusive=True)
            kth = kth_largest(split.magnitudes, [ks[r] for r in computable], at_least)
            empirical.update(zip(computable, kth, strict=True))
        return empirical

    def _fits(
        self,
        base: dict,
        values: torch.Tensor,
        split: SplitValues,
        empirical: dict,
        passes: RowPasses,
    ) -> list[dict]:
        rows = []
        scorer = _Scorer(split, self.sample, self.seed)
        for name in self.dists:
            fit_base = {**base, "kind": "fit", "dist": name, "method": self.method, "stages": 1}
            try:
                dist = scorer.fit(get_distribution(name), self.method)
                scores = scorer.scores(dist)
            except GradstatError as exc:
                rows += [_row(fit_base, ratio=r, error=str(exc)) for r in self.ratios]
                continue
            fit_base.update(params=dist.params, **scores)
            rows += self._quantile_rows(fit_base, dist, empirical, passes, split.count)
        return rows

    def _settings(self, estimator: str, base: dict, ratio: float) -> list[tuple[int, bool]]:
        """(stage count, adaptive) pairs to run for one estimator and ratio."""
        if not ESTIMATORS[estimator].staged:
            return [(1, False)]
        if self.stages is not None:
            return [(s, False) for s in self.stages]
        key = (base["learner"], base["scope"], estimator, ratio)
        adaptive = self._adaptive.setdefault(key, AdaptiveStages())
        return [(adaptive.stages, True)]

    def _estimate(
        self,
        values: torch.Tensor,
        ratio: float,
        estimator: str,
        stages: int,
        generator: torch.Generator,
        empirical: dict,
        shared: RowPasses,
    ) -> ThresholdResult:
        """One estimator's threshold; ``topk`` is the empirical quantile already found."""
        if estimator == "topk" and not isinstance(empirical[ratio], str):
            k = k_for(ratio, values.numel())
            return ThresholdResult(empirical[ratio], k, k, 1, "topk", inclusive=True)
        return estimate_threshold(
            values,
            ratio,
            estimator,
            stages=stages,
            threshold=self.hard_threshold,
            generator=generator,
            zeros=self.params.zeros,
            stage_fit=self.params.stage_fit,
            shared=shared,
        )

    def _estimators(
        self,
        base: dict,
        values: torch.Tensor,
        empirical: dict,
        shared: RowPasses,
        learned: list[tuple],
    ) -> list[dict]:
        """The estimators' records; the (adaptive key, quality) pairs the adaptive stage
        counts learn from go to ``learned``, for :meth:`_learn` once the records are
        final (a tentative run's may be computed again)."""
        rows = []
        generator = torch.Generator().manual_seed(self.seed + int(base["step"]))
        for estimator in self.estimators:
            for ratio in self.ratios:
                for stages, adaptive in self._settings(estimator, base, ratio):
                    row_base = {
                        **base,
                        "kind": "estimator",
                        "dist": ESTIMATORS[estimator].dist,
                        "estimator": estimator,
                        "ratio": ratio,
                        "stages": stages,
                        "adaptive": adaptive,
                    }
                    try:
                        result = self._estimate(
                            values, ratio, estimator, stages, generator, empirical, shared
                        )
                    except GradstatError as exc:
                        rows.append(_row(row_base, error=str(exc)))
                        continue
                    if adaptive:
                        key = (base["learner"], base["scope"], estimator, ratio)
                        learned.append((key, result.quality))
                    rows.append(_estimator_row(row_base, result, empirical[ratio]))
        return rows

    def _learn(self, learned: list[tuple]) -> None:
        """Feed each (adaptive key, quality) pair to its adaptive stage count."""
        for key, quality in learned:
            self._adaptive[key].update(quality)
