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

It streams: one learner's row of one step is in memory at a time. Moment fits (the
default) take every record of a row from one histogram of it (:mod:`gradstat.analysis.fit_row`):
fits, counts, quantiles, log-likelihood, KS and AD over every non-zero value. MLE fits and
their scores use a uniform subsample of ``sample`` values when the scope is larger.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from gradstat import defaults
from gradstat.analysis.compute import Compute
from gradstat.analysis.fit_row import COLUMNS, _Fitter
from gradstat.analysis.selection import (
    LearnersSpec,
    Selection,
    StepsSpec,
    parse_ratios,
    require_one_kept,
)
from gradstat.errors import DataError, UsageError
from gradstat.parallel import Task, run_units
from gradstat.parallel.progress import Progress, no_progress
from gradstat.stats.distributions import DISTRIBUTIONS, METHODS, get_distribution, split_values
from gradstat.stats.goodness import subsample
from gradstat.stats.sidco import check_choices
from gradstat.stats.thresholds import DEFAULT_ESTIMATORS, get_estimator
from gradstat.store import Capture, Scope


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
    values): ``dists`` (``"all"``, a name or names), ``method`` (moments or mle),
    ``ratios``, ``stages`` (stage counts, or ``"auto"``/None for the adaptive rule),
    ``estimators``, ``hard_threshold`` (runs the ``hard`` estimator), ``zeros`` and
    ``stage_fit`` (SIDCo and Gaussian-k: exact zeros excluded, or included as the SIDCo
    reference does; SIDCo's GPD stages by moments or MLE; docs/methods.md 2), ``sample``
    (subsample size of MLE fits and their scores; None or 0: every value) and ``seed``.
    Distribution fits always exclude zeros."""

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
    require_one_kept(selection.scopes(cap), params.ratios)
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
    """Records of ``steps``, one learner's row in memory at a time (read into one
    buffer, then moved to the compute device; its magnitudes in a second buffer: this process's
    :class:`_RowBuffers`)."""
    fitter = _Fitter(params)
    scopes = selection.scopes(cap)
    device = compute.torch_device()
    buffer, magnitudes = _process_buffers.get(cap.numel, device)
    rows: list[dict] = []
    for step in steps:
        for learner in selection.learners:
            row = torch.from_numpy(cap.read_row(step, learner, out=buffer)).to(device)
            for scope in scopes:
                rows.extend(fitter.one(step, learner, scope, scope.take(row), magnitudes))
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
