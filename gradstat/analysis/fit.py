"""``fit``: distribution fits, goodness of fit and threshold estimators over a capture.

For every selected (step, learner, scope) the analysis
* fits each chosen distribution (docs/methods.md 1) to the scope's values, exact zeros and
  NaN/Inf excluded and counted (NaN/Inf also warned about);
* scores it on the magnitudes |g| (normal and Laplace folded, see
  :class:`~gradstat.stats.distributions.Folded`): KS, Anderson-Darling, log-likelihood,
  AIC/BIC, and at each ratio the fitted upper quantile, what it selects and its relative
  error against the empirical quantile (the k-th largest |g|);
* runs the threshold estimators (docs/methods.md 2) at each ratio, SIDCo with each fixed stage
  count or the adaptive rule.

It streams: one learner's row of one step is in memory at a time. MLE fits and the
KS/AD scores use a uniform subsample of ``sample`` values when the scope is larger;
moment fits, thresholds and quantile errors always use every value.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import pandas as pd
import torch

from gradstat import defaults
from gradstat.analysis.compute import Compute
from gradstat.analysis.progress import Progress, no_progress
from gradstat.analysis.selection import (
    LearnersSpec,
    Selection,
    StepsSpec,
    k_for,
    parse_ratios,
)
from gradstat.errors import DataError, GradstatError, GradstatWarning, UsageError
from gradstat.parallel import Task, run_units
from gradstat.stats.distributions import (
    DISTRIBUTIONS,
    METHODS,
    Distribution,
    SplitValues,
    get_distribution,
    split_values,
)
from gradstat.stats.goodness import (
    information_criteria,
    ks_ad,
    quantile_error,
    subsample,
)
from gradstat.stats.passes import RowPasses
from gradstat.stats.sidco import (
    FIRST_STAGE_DENSITY,
    AdaptiveStages,
    check_choices,
    first_stage_level,
)
from gradstat.stats.thresholds import (
    DEFAULT_ESTIMATORS,
    ESTIMATORS,
    ThresholdResult,
    estimate_threshold,
    get_estimator,
)
from gradstat.stats.topk_sets import kth_largest
from gradstat.store import Capture, Scope

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


@dataclass(frozen=True)
class FitParams:
    """The fit's parameters, parsed and validated (text as on the command line or Python
    values): ``dists`` (``"all"``, a name or names), ``method`` (moments or mle),
    ``ratios``, ``stages`` (stage counts, or ``"auto"``/None for the adaptive rule),
    ``estimators``, ``hard_threshold`` (runs the ``hard`` estimator), ``zeros`` and
    ``stage_fit`` (SIDCo and Gaussian-k: exact zeros excluded, or included as the SIDCo
    reference does; SIDCo's GPD stages by moments or MLE; docs/methods.md 2), ``sample``
    (MLE and KS/AD subsample size; None or 0: every value) and ``seed``. Distribution fits
    always exclude zeros."""

    dists: tuple[str, ...] = ("gpd",)
    method: str = "moments"
    ratios: tuple[float, ...] = defaults.RATIOS  # as `gradstat fit`
    stages: tuple[int, ...] | None = (1, 2, 3)
    estimators: tuple[str, ...] = DEFAULT_ESTIMATORS
    hard_threshold: float | None = None
    zeros: str = "exclude"
    stage_fit: str = "moments"
    sample: int | None = 1_000_000
    seed: int = 0

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
        if self.hard_threshold is not None and "hard" not in estimators:
            estimators.append("hard")
        set_ = object.__setattr__
        set_(self, "dists", tuple(parse_dists(self.dists)))
        set_(self, "ratios", tuple(parse_ratios(self.ratios)))
        set_(self, "stages", None if stages is None else tuple(stages))
        set_(self, "estimators", tuple(estimators))
        set_(self, "sample", sample)


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
    Units: steps; one unit of every step with adaptive stages (``stages=None``), whose
    stage counts carry from step to step.
    """
    selection = selection or Selection.of(cap)
    params = params or FitParams()
    compute = compute or Compute()
    steps = selection.steps
    units = [steps] if params.stages is None else [(step,) for step in steps]
    task = Task(fit_unit, str(cap.path), selection, params)
    try:
        outcomes = run_units(cap, task, units, compute, progress)
    finally:
        _process_buffers.release()
    records = pd.DataFrame(outcomes, columns=list(COLUMNS))
    counts = ("n_fit", "stages", "k", "selected")
    records = records.astype(dict.fromkeys(counts, "Int64"))
    if records["error"].notna().all():
        raise DataError(f"nothing could be computed: {records['error'].iloc[0]}")
    return records


class _RowBuffers:
    """A row's read buffer and its magnitudes' buffer, kept from unit to unit of a fit in
    this process (``fit`` frees them at its end): fresh ones cost their page faults
    whenever the allocator has handed the old ones back to the kernel (a 32M-value row:
    0.17 s for the magnitudes' 128 MB, about as much as the rest of its split)."""

    def __init__(self) -> None:
        self._key: tuple[int, str] | None = None
        self._buffers: tuple[np.ndarray, torch.Tensor] | None = None

    def get(self, numel: int, device: torch.device) -> tuple[np.ndarray, torch.Tensor]:
        """(read buffer, magnitudes on ``device``) of ``numel`` float32 each."""
        key = (numel, str(device))
        if self._key != key or self._buffers is None:
            self.release()  # the old pair goes before the new one is allocated
            row = np.empty(numel, dtype=np.float32)
            self._buffers = (row, torch.empty(numel, dtype=torch.float32, device=device))
            self._key = key
        return self._buffers

    def release(self) -> None:
        self._key = self._buffers = None


_process_buffers = _RowBuffers()


def fit_unit(
    cap: Capture,
    selection: Selection,
    params: FitParams,
    compute: Compute,
    steps: Sequence[int],
) -> list[dict]:
    """Records of ``steps``, one learner's row in memory at a time (seen in place in the
    page cache, :meth:`Capture.row_view`, or read into one buffer; then moved to the
    compute device; its magnitudes in a second buffer: this process's
    :class:`_RowBuffers`)."""
    fitter = _Fitter(params)
    scopes = selection.scopes(cap)
    device = compute.torch_device()
    buffer, magnitudes = _process_buffers.get(cap.numel, device)
    rows: list[dict] = []
    for step in steps:
        for learner in selection.learners:
            seen = cap.row_view(step, learner, slice(0, cap.numel))
            values = seen if seen is not None else cap.read_row(step, learner, out=buffer)
            row = torch.from_numpy(values).to(device)
            for scope in scopes:
                rows.extend(fitter.one(step, learner, scope, scope.take(row), magnitudes))
            if seen is not None:
                cap.forget_view(learner, seen)
    return rows


class Fit:
    """The fit analysis with keyword options (the command line's text or Python values):
    ``Fit(cap, dists="all", steps="::10", learners=[0]).run()`` equals
    ``fit(cap, Selection.of(cap, steps, learners, scope), FitParams(...))``."""

    def __init__(
        self,
        cap: Capture,
        *,
        scope: str = "model",
        steps: StepsSpec = None,
        learners: LearnersSpec = None,
        compute: Compute | None = None,
        dists: str | Sequence[str] = "gpd",
        method: str = "moments",
        ratios: str | Sequence[float] = (0.1, 0.01, 0.001),
        stages: str | Sequence[int] | None = (1, 2, 3),
        estimators: str | Sequence[str] = DEFAULT_ESTIMATORS,
        hard_threshold: float | None = None,
        zeros: str = "exclude",
        stage_fit: str = "moments",
        sample: int | None = 1_000_000,
        seed: int = 0,
    ) -> None:
        self.cap = cap
        self.params = FitParams(
            dists=dists,
            method=method,
            ratios=ratios,
            stages=stages,
            estimators=estimators,
            hard_threshold=hard_threshold,
            zeros=zeros,
            stage_fit=stage_fit,
            sample=sample,
            seed=seed,
        )
        self.selection = Selection.of(cap, steps, learners, scope)
        self.compute = compute or Compute()
        self.steps = list(self.selection.steps)
        self.learners = list(self.selection.learners)
        self.scopes: list[Scope] = self.selection.scopes(cap)

    def run(self, progress: Progress = no_progress) -> pd.DataFrame:
        return fit(self.cap, self.selection, self.params, compute=self.compute, progress=progress)


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

    def one(
        self,
        step: int,
        learner: int,
        scope: Scope,
        values: torch.Tensor,
        magnitudes: torch.Tensor | None = None,
    ) -> list[dict]:
        """The records of one vector; ``magnitudes``: a buffer for its |x|, reused from
        row to row (:func:`split_values`)."""
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
        rows += self._estimators(base, values, empirical, passes)
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
            for ratio in self.ratios:
                k = k_for(ratio, values.numel())
                if isinstance(empirical[ratio], str):
                    rows.append(_row(fit_base, ratio=ratio, k=k, error=empirical[ratio]))
                    continue
                threshold = dist.magnitude_isf(k / split.count)
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
        self, base: dict, values: torch.Tensor, empirical: dict, shared: RowPasses
    ) -> list[dict]:
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
                        self._adaptive[key].update(result.quality)
                    reference = empirical[ratio]
                    error = (
                        quantile_error(result.threshold, reference)
                        if not isinstance(reference, str)
                        else math.nan
                    )
                    rows.append(
                        _row(
                            row_base,
                            stages=result.stages,
                            k=result.k,
                            threshold=result.threshold,
                            selected=result.selected,
                            quality=result.quality,
                            empirical=None if isinstance(reference, str) else reference,
                            quantile_error=error,
                        )
                    )
        return rows


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
    split = split_values(scope.take(cap.read_step(step, [learner])[0]))
    if split.magnitudes.numel() == 0:
        raise DataError(f"step {step}, learner {learner}, scope {scope.name}: all values are zero")
    return subsample(split.magnitudes, size, seed).double().numpy()
