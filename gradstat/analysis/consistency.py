"""How consistent the learners are, per step and scope: cosines, dispersions, diversity.

From each step's Gram matrix of the learners' rows (:mod:`gradstat.analysis.gram`;
docs/methods.md 8): the pairwise cosines ``g_a . g_b / (||g_a|| ||g_b||)`` (their mean
and minimum over pairs; every pair in ``pairs``), the coefficient of variation of the
learners' gradient norms and of their recorded losses (population standard deviation
over the mean's magnitude: the dispersions of arXiv 2602.14462), and gradient diversity
``sum_i ||g_i||^2 / ||sum_i g_i||^2`` (Yin et al. 2018, arXiv 1706.05699: 1/n for
identical learners, about 1 for orthogonal ones, larger where they cancel).

With ``compressors``, each compressor's mean relative error over learners
``||C(g_i) - g_i||^2 / ||g_i||^2`` per step (:mod:`gradstat.analysis.learner_errors`)
and, over steps, Spearman's rank correlation (``scipy.stats.spearmanr``) between it and
each of the measures above: whether the compressor errs more where the learners agree
less.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats

from gradstat import defaults
from gradstat.analysis.compute import Compute
from gradstat.analysis.gram import Grams, require_learners, step_units
from gradstat.analysis.learner_errors import learner_errors, plan_configs, unit_configs
from gradstat.analysis.selection import Selection, parse_ratios
from gradstat.parallel import Task, run_units
from gradstat.parallel.progress import Progress, no_progress
from gradstat.store import Capture

WHAT = "the learners' consistency"
#: The per-step measures correlated with a compressor's error.
MEASURES = ("cosine_mean", "cosine_min", "norm_cv", "loss_cv", "diversity")


@dataclass(frozen=True)
class ConsistencyParams:
    """``compressors``: names as in replay (None: none), each sparsifier at each of
    ``ratios``; ``seed`` of the compressors' random streams."""

    compressors: str | None = None
    ratios: tuple[float, ...] = defaults.RATIOS
    seed: int = defaults.SEED

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratios", tuple(parse_ratios(self.ratios)))


@dataclass(frozen=True)
class ConsistencyResult:
    """``steps``: one row per (step, scope); ``pairs``: per (step, scope, learner pair);
    ``compressors``: per (step, scope, compressor, ratio); ``correlations``: per (scope,
    compressor, ratio, measure) over steps. The last two are empty without compressors."""

    steps: pd.DataFrame
    pairs: pd.DataFrame
    compressors: pd.DataFrame
    correlations: pd.DataFrame


def consistency(
    cap: Capture,
    selection: Selection | None = None,
    params: ConsistencyParams | None = None,
    *,
    compute: Compute | None = None,
    progress: Progress = no_progress,
) -> ConsistencyResult:
    """The learners' agreement per step and scope (module docstring).

    ``steps`` columns: step, scope, learners, cosine_mean, cosine_min, norm_mean,
    norm_cv, loss_mean, loss_cv, diversity. ``pairs``: step, scope, learner_a,
    learner_b, cosine. ``compressors``: step, scope, compressor, ratio (NaN for
    fixed-rate ones), rel_error. ``correlations``: scope, compressor, ratio, measure,
    steps, rho, p_value (NaN where a series is constant or under 3 steps). Units: steps.
    """
    selection = selection or Selection.of(cap)
    params = params or ConsistencyParams()
    compute = compute or Compute()
    require_learners(selection, "consistency")
    if params.compressors:
        plan_configs(cap, selection.scopes(cap), params.compressors, params.ratios, params.seed)
    task = Task(consistency_unit, str(cap.path), selection, params, parts=None)
    records = run_units(cap, task, step_units(cap, selection, compute), compute, progress)
    pairs = [pair for record in records for pair in record.pop("pairs")]
    rows = [row for record in records for row in record.pop("compressors")]
    steps, compressors = pd.DataFrame(records), pd.DataFrame(rows)
    return ConsistencyResult(
        steps, pd.DataFrame(pairs), compressors, correlations(steps, compressors)
    )


def consistency_unit(
    cap: Capture,
    selection: Selection,
    params: ConsistencyParams,
    compute: Compute,
    steps: Sequence[int],
    *,
    tick: Callable[[], None] = lambda: None,
) -> list[dict]:
    """Records of ``steps``: one per (step, scope), with its pairs and compressors'
    records (``tick`` after each step)."""
    learners, scopes = list(selection.learners), selection.scopes(cap)
    configs = unit_configs(cap, scopes, params.compressors, params.ratios, params.seed)
    rows = {int(s): i for i, s in enumerate(cap.steps)}
    positions = [cap.learners.index(learner) for learner in learners]
    gram_pass = Grams(cap, learners, scopes, compute, WHAT)
    records = []
    for step in steps:
        losses = cap.losses[positions, rows[int(step)]]
        grams = gram_pass.step(step)
        errors = []
        if configs:
            errors = learner_errors(
                cap, step, learners, scopes, configs, compute, params.seed, WHAT
            )
        for sc, gram in zip(scopes, grams, strict=True):
            record = {"step": step, "scope": sc.name, **agreement(gram, losses)}
            record["pairs"] = _pairs(step, sc.name, learners, gram)
            record["compressors"] = [
                _compressor_record(step, e) for e in errors if e["scope"] == sc.name
            ]
            records.append(record)
        tick()
    return records


def _cv(values: np.ndarray) -> float:
    """Population standard deviation over the mean's magnitude (NaN where non-finite
    values or a zero mean leave it undefined)."""
    mean = float(np.mean(values))
    if not np.isfinite(values).all() or mean == 0:
        return math.nan
    return float(np.std(values)) / abs(mean)


def cosines(gram: np.ndarray) -> np.ndarray:
    """The learners' cosine matrix (NaN in the rows of a zero gradient)."""
    norms = np.sqrt(np.diag(gram))
    with np.errstate(invalid="ignore", divide="ignore"):
        return gram / np.outer(norms, norms)


def agreement(gram: np.ndarray, losses: np.ndarray) -> dict:
    """The measures of one step and scope from its Gram matrix and the learners' losses."""
    n = len(gram)
    upper = cosines(gram)[np.triu_indices(n, k=1)]
    norms = np.sqrt(np.diag(gram))
    total, squares = float(gram.sum()), float(np.trace(gram))
    # learners whose gradients cancel: infinite; all zero: undefined
    diversity = squares / total if total > 0 else (math.inf if squares > 0 else math.nan)
    return {
        "learners": n,
        "cosine_mean": float(upper.mean()),
        "cosine_min": float(upper.min()),
        "norm_mean": float(norms.mean()),
        "norm_cv": _cv(norms),
        "loss_mean": float(np.mean(losses)),
        "loss_cv": _cv(losses),
        "diversity": diversity,
    }


def _pairs(step: int, scope: str, learners: Sequence[int], gram: np.ndarray) -> list[dict]:
    """One record per pair of learners: their cosine."""
    matrix = cosines(gram)
    n = len(learners)
    return [
        {
            "step": step,
            "scope": scope,
            "learner_a": learners[a],
            "learner_b": learners[b],
            "cosine": float(matrix[a, b]),
        }
        for a in range(n)
        for b in range(a + 1, n)
    ]


def _compressor_record(step: int, found: dict) -> dict:
    """One compressor's mean relative error over the learners at a step."""
    errors, norms2 = found["errors"], found["norms2"]
    relative = errors[norms2 > 0] / norms2[norms2 > 0]
    return {
        "step": step,
        "scope": found["scope"],
        "compressor": found["compressor"],
        "ratio": found["ratio"],
        "rel_error": float(relative.mean()) if len(relative) else math.nan,
    }


def correlations(steps: pd.DataFrame, compressors: pd.DataFrame) -> pd.DataFrame:
    """Spearman's rho (and its p-value) over steps between each compressor's relative
    error and each measure of :data:`MEASURES`, per scope, compressor and ratio."""
    columns = ["scope", "compressor", "ratio", "measure", "steps", "rho", "p_value"]
    if compressors.empty:
        return pd.DataFrame(columns=columns)
    merged = compressors.merge(steps, on=["step", "scope"])
    rows = []
    keys = ["scope", "compressor", "ratio"]
    for (scope, name, ratio), group in merged.groupby(keys, sort=False, dropna=False):
        for measure in MEASURES:
            rho, p = _spearman(group[measure].to_numpy(), group["rel_error"].to_numpy())
            rows.append((scope, name, ratio, measure, len(group), rho, p))
    return pd.DataFrame(rows, columns=columns)


def _spearman(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Spearman's rho and p-value of the finite pairs; NaNs under 3 of them or where a
    series is constant (scipy warns and returns NaN there)."""
    kept = np.isfinite(x) & np.isfinite(y)
    x, y = x[kept], y[kept]
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan, math.nan
    result = stats.spearmanr(x, y)
    return float(result.statistic), float(result.pvalue)


def consistency_summary(steps: pd.DataFrame | ConsistencyResult) -> pd.DataFrame:
    """Per scope over steps: mean cosine (and the lowest), the mean dispersions and
    diversity, and the cosine's first and last steps' values (its drift)."""
    if isinstance(steps, ConsistencyResult):
        steps = steps.steps
    grouped = steps.groupby("scope", sort=False)
    return grouped.agg(
        steps=("step", "size"),
        learners=("learners", "first"),
        cosine_mean=("cosine_mean", "mean"),
        cosine_min=("cosine_min", "min"),
        cosine_first=("cosine_mean", "first"),
        cosine_last=("cosine_mean", "last"),
        norm_cv=("norm_cv", "mean"),
        loss_cv=("loss_cv", "mean"),
        diversity=("diversity", "mean"),
    ).reset_index()


def cosine_matrix(pairs: pd.DataFrame) -> pd.DataFrame:
    """The mean cosine over the steps and scopes in ``pairs`` as a symmetric square
    table of the learners (diagonal 1)."""
    learners = list(dict.fromkeys([*pairs["learner_a"], *pairs["learner_b"]]))
    matrix = pd.DataFrame(1.0, index=learners, columns=learners)
    means = pairs.groupby(["learner_a", "learner_b"], sort=False)["cosine"].mean()
    for (a, b), value in means.items():
        matrix.loc[a, b] = matrix.loc[b, a] = value
    return matrix
