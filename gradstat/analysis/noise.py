"""The gradient noise scale B_simple, per step and scope, with an interval over learners.

McCandlish et al. 2018 (arXiv 1812.06162), Appendix A: from each step's Gram matrix of
the learners' rows (:mod:`gradstat.analysis.gram`), the unbiased ``|G|^2`` (``g2``),
``tr(Sigma)`` (``trace``, ``noise = trace / b``) and ``B_simple = tr(Sigma) / |G|^2``;
a bootstrap interval over learners (Hesterberg's expanded percentiles, 2015); over steps
the paper's ratio of moving averages; with ``compressors``, each compressor's error on
each learner's gradient (:mod:`gradstat.analysis.learner_errors`) against the sampling
noise. The formulas: docs/methods.md 8; the columns and the interval's coverage:
docs/noise.md.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
from scipy import stats

from gradstat import defaults
from gradstat.analysis.compute import Compute
from gradstat.analysis.gram import Grams, require_learners, step_units
from gradstat.analysis.learner_errors import learner_errors, plan_configs, unit_configs
from gradstat.analysis.selection import Selection, parse_ratios
from gradstat.errors import GradstatWarning, UsageError
from gradstat.parallel import Task, run_units
from gradstat.parallel.progress import Progress, no_progress
from gradstat.store import Capture

#: Fewest learners for the bootstrap interval (3 learners have 10 distinct resamples:
#: the interval held the truth in 66-73% of synthetic seeds at a 95% level).
MIN_INTERVAL_LEARNERS = 4
WHAT = "the noise scale"


@dataclass(frozen=True)
class NoiseParams:
    """``batch_size``: the per-learner batch b (None: the capture's ``batch_size``
    attribute); ``compressors``: names as in replay (None: none), each sparsifier at each
    of ``ratios``; ``window``: steps of the moving averages; ``resamples`` and
    ``confidence`` of the bootstrap interval; ``seed`` of resampling and compressors."""

    batch_size: int | None = None
    compressors: str | None = None
    ratios: tuple[float, ...] = defaults.RATIOS
    window: int = 10
    resamples: int = 1000
    confidence: float = 0.95
    seed: int = defaults.SEED

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratios", tuple(parse_ratios(self.ratios)))
        _positive("batch_size", self.batch_size, allow_none=True)
        _positive("window", self.window)
        _positive("resamples", self.resamples)
        if not 0.0 < self.confidence < 1.0:
            raise UsageError(f"confidence={self.confidence}: must be in (0, 1), e.g. 0.95")


def _positive(name: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name}={value!r}: must be an integer of at least 1")


@dataclass(frozen=True)
class NoiseResult:
    """``steps``: one row per (step, scope); ``compressors``: one per (step, scope,
    compressor, ratio), empty without compressors; ``batch_size``: the b used."""

    steps: pd.DataFrame
    compressors: pd.DataFrame
    batch_size: int


def batch_size_of(cap: Capture, given: int | None) -> int:
    """The per-learner batch: ``given``, else the capture's; a ``UsageError`` without
    either. A ``given`` that differs from the recorded one wins, with a warning."""
    recorded = cap.batch_size
    if given is None:
        if recorded is None:
            raise UsageError(
                f"{cap.path} does not record the per-learner batch size (captures made "
                "before gradstat recorded it, or GradientCapture without batch_size=); "
                "give it with --batch-size B (batch_size= in Python)"
            )
        return recorded
    if recorded is not None and recorded != given:
        warnings.warn(
            f"batch size {given} given, but {cap.path} recorded {recorded}; using {given}",
            GradstatWarning,
            stacklevel=3,
        )
    return given


def noise(
    cap: Capture,
    selection: Selection | None = None,
    params: NoiseParams | None = None,
    *,
    compute: Compute | None = None,
    progress: Progress = no_progress,
) -> NoiseResult:
    """B_simple per step and scope with its bootstrap interval over learners, the
    moving averages over steps, and (``params.compressors``) each compressor's error
    against the sampling noise.

    ``steps`` columns: step, scope, learners, batch_size, g_small2 (mean ||g_i||^2),
    g_big2 (||mean g_i||^2), g2, trace, noise (trace / b), b_simple, ci_low, ci_high,
    g2_avg, trace_avg, b_simple_avg (over the last ``window`` steps). ``compressors``
    columns: step, scope, compressor, ratio (NaN for fixed-rate ones), error (mean over
    learners of ||C(g_i) - g_i||^2), rel_error (mean of ||C(g_i) - g_i||^2 / ||g_i||^2),
    noise, noise_ratio (error / noise), noise_ratio_max (the worst learner's). Units:
    steps.
    """
    selection = selection or Selection.of(cap)
    params = params or NoiseParams()
    compute = compute or Compute()
    require_learners(selection, "noise")
    params = replace(params, batch_size=batch_size_of(cap, params.batch_size))
    if len(selection.learners) < MIN_INTERVAL_LEARNERS:
        warnings.warn(
            f"{len(selection.learners)} learners: too few for a bootstrap interval over "
            f"learners (it needs {MIN_INTERVAL_LEARNERS}); ci_low and ci_high are left out",
            GradstatWarning,
            stacklevel=2,
        )
    if params.compressors:
        plan_configs(cap, selection.scopes(cap), params.compressors, params.ratios, params.seed)
    task = Task(noise_unit, str(cap.path), selection, params, parts=None)
    records = run_units(cap, task, step_units(cap, selection, compute), compute, progress)
    rows = [row for record in records for row in record.pop("compressors")]
    steps = moving_averages(pd.DataFrame(records), params.window)
    return NoiseResult(steps, pd.DataFrame(rows), params.batch_size)


def noise_unit(
    cap: Capture,
    selection: Selection,
    params: NoiseParams,
    compute: Compute,
    steps: Sequence[int],
    *,
    tick: Callable[[], None] = lambda: None,
) -> list[dict]:
    """Records of ``steps``: one per (step, scope), its compressors' under ``"compressors"``
    (``tick`` after each step)."""
    learners, scopes = list(selection.learners), selection.scopes(cap)
    configs = unit_configs(cap, scopes, params.compressors, params.ratios, params.seed)
    b = int(params.batch_size or 0)
    gram_pass = Grams(cap, learners, scopes, compute, WHAT)
    records = []
    for step in steps:
        grams = gram_pass.step(step)
        errors = []
        if configs:
            errors = learner_errors(
                cap, step, learners, scopes, configs, compute, params.seed, WHAT
            )
        for k, (sc, gram) in enumerate(zip(scopes, grams, strict=True)):
            rng = np.random.default_rng([params.seed, step, k])
            record = {"step": step, "scope": sc.name, **noise_scale(gram, b)}
            record["ci_low"], record["ci_high"] = interval(gram, b, rng, params)
            record["compressors"] = [
                _compressor_record(step, record["noise"], e)
                for e in errors
                if e["scope"] == sc.name
            ]
            records.append(record)
        tick()
    return records


def noise_scale(gram: np.ndarray, b: int) -> dict:
    """The estimates of one step and scope from its Gram matrix (docs/methods.md 8)."""
    n = len(gram)
    small = float(np.trace(gram)) / n
    big = float(gram.sum()) / n**2
    g2 = (n * big - small) / (n - 1)
    noise = n / (n - 1) * (small - big)
    return {
        "learners": n,
        "batch_size": b,
        "g_small2": small,
        "g_big2": big,
        "g2": g2,
        "trace": b * noise,
        "noise": noise,
        "b_simple": b * noise / g2 if g2 > 0 else (math.inf if small > 0 else math.nan),
    }


def interval(
    gram: np.ndarray, b: int, rng: np.random.Generator, params: NoiseParams
) -> tuple[float, float]:
    """The expanded percentile bootstrap interval of B_simple over learners: learners
    resampled with multiplicities w give ``|G|^2*``, the w-weighted mean of ``g_i . g_j``
    over pairs of distinct learners, over the same weighting of their squared norms;
    percentiles at levels widened so that ``z = sqrt(n / (n - 1)) t_(n-1)``
    (docs/methods.md 8). NaNs under ``MIN_INTERVAL_LEARNERS`` learners."""
    n = len(gram)
    if n < MIN_INTERVAL_LEARNERS or not np.trace(gram) > 0:
        return math.nan, math.nan
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=params.resamples).astype(np.float64)
    diag = np.diag(gram)
    pairs = n * n - (counts**2).sum(axis=1)  # weight of pairs of distinct learners
    cross = ((counts @ gram) * counts).sum(axis=1) - (counts**2) @ diag
    norms = (counts * (n - counts)) @ diag  # the squared norms, weighted alike
    kept = (pairs > 0) & (norms > 0)  # pairs of distinct learners, not all zero
    share = cross[kept] / norms[kept]  # |G|^2* / mean ||g_i||^2*, at most 1
    z = math.sqrt(n / (n - 1)) * stats.t.ppf((1 + params.confidence) / 2, n - 1)
    tail = float(stats.norm.sf(z))
    low, high = np.quantile(share, [tail, 1 - tail])

    def b_simple(r: float) -> float:
        return b * (1 / r - 1) if r > 0 else math.inf

    return b_simple(high), b_simple(low)


def _compressor_record(step: int, noise: float, found: dict) -> dict:
    """One compressor's record at a step from its learners' errors."""
    errors, norms2 = found["errors"], found["norms2"]
    error = float(errors.mean())
    relative = errors / np.where(norms2 > 0, norms2, np.nan)
    return {
        "step": step,
        "scope": found["scope"],
        "compressor": found["compressor"],
        "ratio": found["ratio"],
        "error": error,
        "rel_error": float(np.nanmean(relative)) if np.isfinite(relative).any() else math.nan,
        "noise": noise,
        "noise_ratio": error / noise if noise > 0 else math.inf,
        "noise_ratio_max": float(errors.max()) / noise if noise > 0 else math.inf,
    }


def moving_averages(steps: pd.DataFrame, window: int) -> pd.DataFrame:
    """``steps`` with ``g2_avg``, ``trace_avg`` and ``b_simple_avg`` per scope: the means
    of g2 and trace over the last ``window`` rows (fewer at the start) and their ratio."""
    steps = steps.copy()
    grouped = steps.groupby("scope", sort=False)
    for column in ("g2", "trace"):
        rolled = grouped[column].rolling(window, min_periods=1).mean()
        steps[f"{column}_avg"] = rolled.reset_index(level=0, drop=True)
    g2 = steps["g2_avg"]
    steps["b_simple_avg"] = np.where(g2 > 0, steps["trace_avg"] / g2.where(g2 > 0), np.inf)
    return steps


def noise_summary(steps: pd.DataFrame | NoiseResult) -> pd.DataFrame:
    """Per scope over steps: the paper's B_simple as a ratio of the means of trace and
    g2, the median of the steps' B_simple and of their intervals, and ``learners_at_b``
    = B_simple / b, how many learners of batch b make a batch of B_simple."""
    if isinstance(steps, NoiseResult):
        steps = steps.steps
    grouped = steps.groupby("scope", sort=False)
    summary = grouped.agg(
        steps=("step", "size"),
        learners=("learners", "first"),
        batch_size=("batch_size", "first"),
        g2=("g2", "mean"),
        trace=("trace", "mean"),
        noise=("noise", "mean"),
        step_median=("b_simple", "median"),
        ci_low=("ci_low", "median"),
        ci_high=("ci_high", "median"),
    ).reset_index()
    g2 = summary["g2"]
    b_simple = np.where(g2 > 0, summary["trace"] / g2.where(g2 > 0), np.inf)
    summary.insert(summary.columns.get_loc("noise") + 1, "b_simple", b_simple)
    summary["learners_at_b"] = summary["b_simple"] / summary["batch_size"]
    return summary


def compressor_summary(compressors: pd.DataFrame) -> pd.DataFrame:
    """Per scope, compressor and ratio over steps: the mean and largest noise ratio and
    the share of steps whose error is within the sampling noise (ratio < 1)."""
    grouped = compressors.groupby(["scope", "compressor", "ratio"], sort=False, dropna=False)
    return grouped.agg(
        steps=("step", "size"),
        error=("error", "mean"),
        rel_error=("rel_error", "mean"),
        noise=("noise", "mean"),
        noise_ratio=("noise_ratio", "mean"),
        noise_ratio_max=("noise_ratio_max", "max"),
        within_noise=("noise_ratio", lambda r: float((r < 1).mean())),
    ).reset_index()
