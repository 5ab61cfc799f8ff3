"""Temporal stability of top-k sets: overlap between recorded step t and t + lag.

O(I_t, I_t+lag) = |I_t n I_t+lag| / k per learner and for the top-k of the mean
gradient (docs/methods.md 3, "step t vs t+1"); high overlap means the same coordinates stay
large, which index reuse and stale-index schemes rely on. ``lag`` counts rows of the
selected recorded steps, so each row states the real training-step gap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from gradstat import defaults
from gradstat.analysis.compute import Compute
from gradstat.analysis.selection import Selection, parse_ratios
from gradstat.analysis.similarity import by_ratio, check_on, plan_sets, step_sets
from gradstat.errors import UsageError
from gradstat.parallel import Progress, Task, no_progress, planned_workers, run_units, runs
from gradstat.stats.topk_sets import (
    jaccard,
    paired_intersection_sizes,
    random_overlap,
)
from gradstat.stats.topk_sets import (
    overlap as set_overlap,
)
from gradstat.store import Capture, Scope


@dataclass(frozen=True)
class OverlapParams:
    """``ratios``: densities k/d (``"0.01,0.001"``, a number or a sequence; one read of
    each step serves them all); ``lag``: compare each selected step with the one ``lag``
    selected steps on; ``on``: ``raw`` or ``ef``. Defaults: :mod:`gradstat.defaults`."""

    ratios: tuple[float, ...] = defaults.SET_RATIOS
    lag: int = defaults.LAG
    on: str = defaults.ON

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratios", tuple(parse_ratios(self.ratios)))
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 1:
            raise UsageError(f"lag={self.lag!r}: must be an integer of at least 1")
        check_on(self.on)


def overlap(
    cap: Capture,
    selection: Selection | None = None,
    params: OverlapParams | None = None,
    *,
    compute: Compute | None = None,
    progress: Progress = no_progress,
) -> pd.DataFrame:
    """Overlap of each learner's (and the mean's) top-k sets between steps ``lag`` rows apart.

    Columns: step, next_step, gap (next_step - step, in training steps), scope, ratio,
    k, d, learner (rank or "mean"), overlap, jaccard, random_overlap (k/d); in the order
    of the ratios. Units: runs of the pairs (step, step ``lag`` on), one per process, for
    ``on="raw"``; one unit of every pair for ``on="ef"`` (the memories carry from step to
    step). A unit keeps the index sets of its last ``lag + 1`` steps, so it reads each
    step once: memory O(lag n k) beyond one step.
    """
    selection = selection or Selection.of(cap)
    params = params or OverlapParams()
    compute = compute or Compute()
    steps, lag = selection.steps, params.lag
    if len(steps) <= lag:
        raise UsageError(
            f"lag={lag} needs more than {lag} selected steps; the selection has {len(steps)}"
        )
    plan_sets(cap, selection, params.ratios, params.on, 1, "overlap", compute)
    if params.on == "ef":  # pairs of the steps as error feedback walks them: recorded order
        chosen = set(steps)
        steps = tuple(step for step in map(int, cap.steps) if step in chosen)
    pairs = [(steps[i], steps[i + lag]) for i in range(len(steps) - lag)]
    if params.on == "ef":
        units = [pairs]
    else:
        units = runs(pairs, planned_workers(cap, selection, compute.jobs))
    task = Task(overlap_unit, str(cap.path), selection, params, parts=None)
    return pd.DataFrame(by_ratio(run_units(cap, task, units, compute, progress), params.ratios))


def overlap_unit(
    cap: Capture,
    selection: Selection,
    params: OverlapParams,
    compute: Compute,
    unit: Sequence,
    *,
    tick: Callable[[], None] = lambda: None,
) -> list[dict]:
    """Records of a unit: a run of pairs (step, step ``lag`` on), its steps read in the
    selection's order (``on="ef"``: the walk of error feedback's memories)."""
    rows: list[dict] = []
    needed = {step for pair in unit for step in pair}
    order = [step for step in selection.steps if step in needed]
    pairs = deque(unit)
    recent: dict[int, list] = {}  # the sets of steps read whose pairs are to come
    for step, found in step_sets(cap, selection, params.ratios, params.on, order, compute):
        recent[step] = found
        while pairs and pairs[0][0] in recent and pairs[0][1] in recent:
            first_step, second = pairs.popleft()
            before = recent.pop(first_step)  # later pairs start later
            for (sc, ratio, first), (_, _, sets) in zip(before, recent[second], strict=True):
                rows += _pair_records(
                    selection, sc, ratio, sets.k, first_step, first.indices, second, sets.indices
                )
            tick()
    return rows


def _pair_records(
    selection: Selection,
    sc: Scope,
    ratio: float,
    k: int,
    first_step: int,
    first: torch.Tensor,
    step: int,
    indices: torch.Tensor,
) -> list[dict]:
    """One record per learner and the mean: the overlap of its sets at the two steps."""
    d = sc.numel
    inter = paired_intersection_sizes(first, indices)
    over, jac = set_overlap(inter, k), jaccard(inter, k)
    names: list[int | str] = [*selection.learners, "mean"]
    return [
        {
            "step": first_step,
            "next_step": step,
            "gap": step - first_step,
            "scope": sc.name,
            "ratio": ratio,
            "k": k,
            "d": d,
            "learner": name,
            "overlap": float(over[i]),
            "jaccard": float(jac[i]),
            "random_overlap": random_overlap(d, k),
        }
        for i, name in enumerate(names)
    ]


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
