"""Gradient build-up: how the union of local top-k sets grows as learners are added.

An all-gather of sparse (index, value) pairs aggregates U = |union_i I_i| non-zeros, so
the reduced gradient has density U/d, not k/d (ScaleCom, arXiv 2104.11125; docs/methods.md
3 and 5). B(m) = E[U(m)] / k for m = 1..n is averaged exactly over every learner order
(equivalently every m-subset), from the multiplicity histogram (``buildup_curve``); the
random baseline assumes independent uniformly random k-subsets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from gradstat import defaults
from gradstat.analysis.compute import Compute
from gradstat.analysis.selection import Selection
from gradstat.analysis.similarity import SimilarityParams, plan_sets, step_sets
from gradstat.parallel import Progress, Task, no_progress, run_units
from gradstat.stats.topk_sets import (
    buildup_curve,
    random_union,
    set_overlaps,
)
from gradstat.store import Capture

#: Bytes per index and per value of the sparse pairs and of dense values (int32, float32).
INDEX_BYTES = 4
VALUE_BYTES = 4


@dataclass(frozen=True)
class BuildupParams(SimilarityParams):
    """``ratios`` and ``on`` as :class:`SimilarityParams`, the ratios' default that of
    the other analyses (:data:`gradstat.defaults.RATIOS`)."""

    ratios: tuple[float, ...] = defaults.RATIOS


def buildup(
    cap: Capture,
    selection: Selection | None = None,
    params: BuildupParams | None = None,
    *,
    compute: Compute | None = None,
    progress: Progress = no_progress,
) -> pd.DataFrame:
    """B(m) per step, scope and ratio, against the random baseline.

    Columns: step, scope, ratio, k, d, m, union (E[U(m)] over learner orders), buildup
    (union / k), random_union, random_buildup, density (union / d, the effective density
    after an all-gather), allgather_vs_allreduce: bytes of an all-gather of m learners' k
    (int32 index, float32 value) pairs over those of a dense float32 ring all-reduce,
    (m - 1) k (s_i + s_v) / (2 (m - 1) / m d s_v) = m k (s_i + s_v) / (2 d s_v)
    (docs/methods.md 5; for m = 1 the limit); below 1 the sparse all-gather moves fewer bytes.
    Units: runs of steps (``plan_sets``).
    """
    selection = selection or Selection.of(cap)
    params = params or BuildupParams()
    compute = compute or Compute()
    units = plan_sets(cap, selection, params.ratios, params.on, 2, "build-up", compute)
    task = Task(buildup_unit, str(cap.path), selection, params, parts=None)
    return pd.DataFrame(run_units(cap, task, units, compute, progress))


def buildup_unit(
    cap: Capture,
    selection: Selection,
    params: BuildupParams,
    compute: Compute,
    steps: Sequence[int],
    *,
    tick: Callable[[], None] = lambda: None,
) -> list[dict]:
    """Records of ``steps``: one per (step, scope, ratio, m)."""
    n = len(selection.learners)
    rows = []
    walk = step_sets(cap, selection, params.ratios, params.on, steps, compute, with_mean=False)
    for step, found in walk:
        for sc, ratio, sets in found:
            _, histogram = set_overlaps(sets.indices, n)
            union = buildup_curve(histogram, n)
            rows.extend(buildup_records(step, sc.name, ratio, sets.k, sc.numel, union))
        tick()
    return rows


def buildup_records(
    step: int, scope: str, ratio: float, k: int, d: int, union: torch.Tensor
) -> list[dict]:
    """One record per m = 1..n from E[U(m)] (``union``, float64 ``[n]``)."""
    n = union.numel()
    m = torch.arange(1, n + 1)
    rand = random_union(d, k, m)
    traffic = m.double() * k * (INDEX_BYTES + VALUE_BYTES) / (2 * d * VALUE_BYTES)
    return [
        {
            "step": step,
            "scope": scope,
            "ratio": ratio,
            "k": k,
            "d": d,
            "m": i + 1,
            "union": float(union[i]),
            "buildup": float(union[i]) / k,
            "random_union": float(rand[i]),
            "random_buildup": float(rand[i]) / k,
            "density": float(union[i]) / d,
            "allgather_vs_allreduce": float(traffic[i]),
        }
        for i in range(n)
    ]


def buildup_summary(records: pd.DataFrame) -> pd.DataFrame:
    """Means over steps of B(m) per scope, ratio and m."""
    grouped = records.groupby(["scope", "ratio", "m"], sort=False)
    return grouped.agg(
        k=("k", "first"),
        d=("d", "first"),
        steps=("step", "size"),
        union=("union", "mean"),
        buildup=("buildup", "mean"),
        buildup_max=("buildup", "max"),
        random_buildup=("random_buildup", "first"),
        density=("density", "mean"),
        allgather_vs_allreduce=("allgather_vs_allreduce", "first"),
    ).reset_index()
