"""Gradient build-up: how the union of local top-k sets grows as learners are added.

An all-gather of sparse (index, value) pairs aggregates U = |union_i I_i| non-zeros, so
the reduced gradient has density U/d, not k/d (ScaleCom, arXiv 2104.11125; docs/methods.md
3 and 5). B(m) = E[U(m)] / k for m = 1..n is averaged exactly over every learner order
(equivalently every m-subset), from the multiplicity histogram (``buildup_curve``); the
random baseline assumes independent uniformly random k-subsets.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch

from gradstat.analysis.progress import Progress, no_progress
from gradstat.analysis.similarity import check_learners, scoped_vectors
from gradstat.stats.topk_sets import (
    buildup_curve,
    multiplicity_histogram,
    random_union,
    set_overlaps,
    topk_indices,
)
from gradstat.store import Capture

#: Bytes per index and per value of the sparse pairs and of dense values (int32, float32).
INDEX_BYTES = 4
VALUE_BYTES = 4


def buildup(
    cap: Capture,
    ratios: Sequence[float],
    *,
    scope: str = "model",
    steps: Sequence[int] | None = None,
    learners: Sequence[int] | None = None,
    on: str = "raw",
    progress: Progress = no_progress,
) -> pd.DataFrame:
    """B(m) per step, scope and ratio, against the random baseline.

    Columns: step, scope, ratio, k, d, m, union (E[U(m)] over learner orders), buildup
    (union / k), random_union, random_buildup, density (union / d, the effective density
    after an all-gather), allgather_vs_allreduce: bytes of an all-gather of m learners' k
    (int32 index, float32 value) pairs over those of a dense float32 ring all-reduce,
    (m - 1) k (s_i + s_v) / (2 (m - 1) / m d s_v) = m k (s_i + s_v) / (2 d s_v)
    (docs/methods.md 5; for m = 1 the limit); below 1 the sparse all-gather moves fewer bytes.
    """
    learners = check_learners(cap.learners if learners is None else learners, 2, "build-up")
    n = len(learners)
    m = torch.arange(1, n + 1)
    rows = []
    for step, sc, ratio, k, x in scoped_vectors(
        cap, ratios, scope=scope, steps=steps, learners=learners, on=on, progress=progress
    ):
        d = sc.numel
        _, holders = set_overlaps(topk_indices(x, k), d, n)
        union = buildup_curve(multiplicity_histogram(holders, n), n)
        rand = random_union(d, k, m)
        traffic = m.double() * k * (INDEX_BYTES + VALUE_BYTES) / (2 * d * VALUE_BYTES)
        for i in range(n):
            rows.append(
                {
                    "step": step,
                    "scope": sc.name,
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
            )
    return pd.DataFrame(rows)


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
