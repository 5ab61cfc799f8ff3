"""Temporal stability of top-k sets: overlap between recorded step t and t + lag.

O(I_t, I_t+lag) = |I_t n I_t+lag| / k per learner and for the top-k of the mean
gradient (docs/methods.md 3, "step t vs t+1"); high overlap means the same coordinates stay
large, which index reuse and stale-index schemes rely on. ``lag`` counts rows of the
selected recorded steps, so each row states the real training-step gap.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from gradstat.analysis.compute import Compute
from gradstat.analysis.row_workspace import release_workspace
from gradstat.analysis.selection import Selection, parse_ratios
from gradstat.analysis.similarity import check_on, plan_sets, step_sets
from gradstat.errors import UsageError
from gradstat.parallel import Task, run_units
from gradstat.parallel.progress import Progress, no_progress
from gradstat.stats.topk_sets import (
    jaccard,
    overlap,
    paired_intersection_sizes,
    random_overlap,
)
from gradstat.store import Capture, Scope


@dataclass(frozen=True)
class OverlapParams:
    """``ratio``: density k/d; ``lag``: compare each selected step with the one ``lag``
    selected steps on; ``on``: ``raw`` or ``ef``."""

    ratio: float = 0.001
    lag: int = 1
    on: str = "raw"

    def __post_init__(self) -> None:
        (ratio,) = parse_ratios(self.ratio)
        object.__setattr__(self, "ratio", ratio)
        if isinstance(self.lag, bool) or not isinstance(self.lag, int) or self.lag < 1:
            raise UsageError(f"lag={self.lag!r}: must be an integer of at least 1")
        check_on(self.on)


def temporal_overlap(
    cap: Capture,
    selection: Selection | None = None,
    params: OverlapParams | None = None,
    *,
    compute: Compute | None = None,
    progress: Progress = no_progress,
) -> pd.DataFrame:
    """Overlap of each learner's (and the mean's) top-k sets between steps ``lag`` rows apart.

    Columns: step, next_step, gap (next_step - step, in training steps), scope, ratio,
    k, d, learner (rank or "mean"), overlap, jaccard, random_overlap (k/d). Units: the
    pairs (step, step ``lag`` on) for ``on="raw"`` (each process keeps the index sets of
    the last ``lag + 1`` steps, so a run of pairs reads each step once: memory
    O(lag n k) beyond one step); one unit of every step for ``on="ef"``.
    """
    selection = selection or Selection.of(cap)
    params = params or OverlapParams()
    compute = compute or Compute()
    steps, lag = selection.steps, params.lag
    if len(steps) <= lag:
        raise UsageError(
            f"lag={lag} needs more than {lag} selected steps; the selection has {len(steps)}"
        )
    plan_sets(cap, selection, [params.ratio], params.on, 1, "overlap")
    if params.on == "ef":
        units = [steps]
    else:
        units = [(steps[i], steps[i + lag]) for i in range(len(steps) - lag)]
    task = Task(overlap_unit, str(cap.path), selection, params)
    try:
        return pd.DataFrame(run_units(cap, task, units, compute, progress))
    finally:
        release_workspace()


ScopeSets = dict[str, tuple[Scope, int, torch.Tensor]]
#: Index sets of recently seen steps in this process: {key: {scope name: (scope, k,
#: indices [n + 1, k])}}.
_recent_sets: OrderedDict[tuple, ScopeSets] = OrderedDict()


def _step_sets(
    cap: Capture, selection: Selection, params: OverlapParams, compute: Compute, step: int
) -> ScopeSets:
    """Top-k sets of every learner and of the mean at ``step`` per scope, cached for the
    next ``lag`` pairs."""
    key = (str(cap.path), selection, params, step)
    if key in _recent_sets:
        _recent_sets.move_to_end(key)
        return _recent_sets[key]
    sets = {}
    for _, sc, _, found in step_sets(cap, selection, [params.ratio], "raw", [step], compute):
        sets[sc.name] = (sc, found.k, found.indices)
    _recent_sets[key] = sets
    while len(_recent_sets) > params.lag + 1:
        _recent_sets.popitem(last=False)
    return sets


def overlap_unit(
    cap: Capture,
    selection: Selection,
    params: OverlapParams,
    compute: Compute,
    steps: Sequence[int],
) -> list[dict]:
    """Records of a unit: a pair (step, step ``lag`` on), or (``on="ef"``) every step."""
    if params.on == "raw":
        first_step, step = steps
        first, second = (_step_sets(cap, selection, params, compute, s) for s in steps)
        rows = []
        for name, (sc, k, indices) in second.items():
            before = first[name][2]
            rows += _pair_records(selection, params, sc, k, first_step, before, step, indices)
        return rows
    history: dict[str, deque] = {}
    rows = []
    for step, sc, _, found in step_sets(cap, selection, [params.ratio], "ef", steps, compute):
        k = found.k
        past = history.setdefault(sc.name, deque(maxlen=params.lag + 1))
        past.append((step, found.indices))
        if len(past) > params.lag:
            first_step, first = past[0]
            rows += _pair_records(selection, params, sc, k, first_step, first, step, past[-1][1])
    return rows


def _pair_records(
    selection: Selection,
    params: OverlapParams,
    sc: Scope,
    k: int,
    first_step: int,
    first: torch.Tensor,
    step: int,
    indices: torch.Tensor,
) -> list[dict]:
    """One record per learner and the mean: the overlap of its sets at the two steps."""
    d = sc.numel
    inter = paired_intersection_sizes(first, indices)
    over, jac = overlap(inter, k), jaccard(inter, k)
    names: list[int | str] = [*selection.learners, "mean"]
    return [
        {
            "step": first_step,
            "next_step": step,
            "gap": step - first_step,
            "scope": sc.name,
            "ratio": params.ratio,
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
