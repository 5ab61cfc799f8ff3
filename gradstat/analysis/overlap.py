"""Temporal stability of top-k sets: overlap between recorded step t and t + lag.

O(I_t, I_t+lag) = |I_t n I_t+lag| / k per learner and for the top-k of the mean
gradient (docs/methods.md 3, "step t vs t+1"); high overlap means the same coordinates stay
large, which index reuse and stale-index schemes rely on. ``lag`` counts rows of the
selected recorded steps, so each row states the real training-step gap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import pandas as pd
import torch

from gradstat.analysis.progress import Progress, no_progress
from gradstat.analysis.similarity import scoped_vectors
from gradstat.errors import UsageError
from gradstat.stats.topk_sets import (
    jaccard,
    overlap,
    paired_intersection_sizes,
    random_overlap,
    topk_indices,
)
from gradstat.store import Capture


def temporal_overlap(
    cap: Capture,
    ratio: float,
    *,
    lag: int = 1,
    scope: str = "model",
    steps: Sequence[int] | None = None,
    learners: Sequence[int] | None = None,
    on: str = "raw",
    progress: Progress = no_progress,
) -> pd.DataFrame:
    """Overlap of each learner's (and the mean's) top-k sets between steps ``lag`` rows apart.

    Columns: step, next_step, gap (next_step - step, in training steps), scope, ratio,
    k, d, learner (rank or "mean"), overlap, jaccard, random_overlap (k/d). Keeps only
    the last ``lag`` steps' index sets, so memory is O(lag n k) beyond one step.
    """
    steps = [int(s) for s in (cap.steps if steps is None else steps)]
    learners = cap.learners if learners is None else list(learners)
    if lag < 1:
        raise UsageError(f"--lag {lag}: must be at least 1")
    if len(steps) <= lag:
        raise UsageError(
            f"--lag {lag} needs more than {lag} selected steps; the selection has {len(steps)}"
        )
    names: list[int | str] = [*learners, "mean"]
    history: dict[tuple[str, float], deque] = {}
    rows = []
    for step, sc, ratio_, k, x in scoped_vectors(
        cap, [ratio], scope=scope, steps=steps, learners=learners, on=on, progress=progress
    ):
        d = sc.numel
        indices = torch.cat([topk_indices(x, k), topk_indices(x.mean(dim=0), k)[None]])
        past = history.setdefault((sc.name, ratio_), deque(maxlen=lag + 1))
        past.append((step, indices))
        if len(past) <= lag:
            continue
        first_step, first = past[0]
        inter = paired_intersection_sizes(first, indices, d)
        over, jac = overlap(inter, k), jaccard(inter, k)
        for i, name in enumerate(names):
            rows.append(
                {
                    "step": first_step,
                    "next_step": step,
                    "gap": step - first_step,
                    "scope": sc.name,
                    "ratio": ratio_,
                    "k": k,
                    "d": d,
                    "learner": name,
                    "overlap": float(over[i]),
                    "jaccard": float(jac[i]),
                    "random_overlap": random_overlap(d, k),
                }
            )
    return pd.DataFrame(rows)


def overlap_summary(records: pd.DataFrame) -> pd.DataFrame:
    """Mean and minimum overlap over step pairs per scope, ratio and learner."""
    grouped = records.groupby(["scope", "ratio", "learner"], sort=False)
    return grouped.agg(
        k=("k", "first"),
        pairs=("step", "size"),
        gap_min=("gap", "min"),
        gap_max=("gap", "max"),
        mean_overlap=("overlap", "mean"),
        min_overlap=("overlap", "min"),
        mean_jaccard=("jaccard", "mean"),
        random_overlap=("random_overlap", "first"),
    ).reset_index()
