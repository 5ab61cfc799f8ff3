"""Cross-learner similarity of top-k index sets (ScaleCom, arXiv 2104.11125; docs/methods.md 3).

Per step and scope: the learner x learner overlap / Jaccard / Hamming of the top-k sets,
each learner's overlap with the top-k of the mean gradient (the quantity in ScaleCom's
theory), the energy of the mean gradient that each learner's set captures, ScaleCom's
contraction check with each learner as the CLT-k leader, and the random baseline k/d.

``step_sets`` is the step walk shared with build-up and temporal overlap: the top-k sets
of raw gradients streamed learner by learner (``topk_stream``), or of
error-feedback-corrected vectors (``on="ef"``, see ``ef_vectors``), at every ratio from
one read of each step; ``plan_sets`` checks a top-k set analysis once and cuts it into
units: runs of steps, one per process, each reading into buffers of its own.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from gradstat import defaults
from gradstat.analysis.compute import Compute
from gradstat.analysis.ef_vectors import ef_vectors
from gradstat.analysis.selection import Selection, parse_ratios, require_one_kept
from gradstat.analysis.topk_stream import SetBuffers, StepSets, stream_step_sets
from gradstat.errors import GradstatWarning, UsageError
from gradstat.parallel import Progress, Task, no_progress, planned_workers, run_units, runs
from gradstat.stats.density import k_for
from gradstat.stats.rows import require_finite
from gradstat.stats.topk_sets import (
    TopkSetMetrics,
    energy_captured,
    random_overlap,
    random_union,
    set_overlaps,
    topk_indices,
)
from gradstat.store import Capture, Scope

ON_CHOICES = ("raw", "ef")


def check_on(on: str) -> str:
    """``raw`` or ``ef``."""
    if on not in ON_CHOICES:
        raise UsageError(f"on={on!r}: expected one of {', '.join(ON_CHOICES)}")
    return on


def usable_scopes(
    scopes: Sequence[Scope], ratios: Sequence[float], *, warn: bool = True
) -> list[Scope]:
    """Scopes in which every ratio keeps fewer than all elements (k < d).

    A single scope where k >= d is an error; with several (``scope="layers"``) such scopes
    are skipped with a warning.
    """
    require_one_kept(scopes, ratios)
    usable, skipped = [], []
    for scope in scopes:
        kept = all(k_for(r, scope.numel) < scope.numel for r in ratios)
        (usable if kept else skipped).append(scope)
    if not usable:
        scope = skipped[0]
        k = max(k_for(r, scope.numel) for r in ratios)
        raise UsageError(
            f"ratio {max(ratios):g} keeps k={k} of the {scope.numel} elements of scope "
            f"{scope.name!r}: every element would be selected; use a smaller ratio or scope"
        )
    if skipped and warn:
        names = ", ".join(s.name for s in skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        warnings.warn(
            f"skipping {len(skipped)} scope(s) too small for ratio {max(ratios):g} (k >= numel): "
            f"{names}",
            GradstatWarning,
            stacklevel=3,
        )
    return usable


def plan_sets(
    cap: Capture,
    selection: Selection,
    ratios: Sequence[float],
    on: str,
    minimum: int,
    what: str,
    compute: Compute,
) -> list[tuple[int, ...]]:
    """Check a top-k set analysis once and return its units.

    ``on="raw"``: runs of steps, one per process (:func:`~gradstat.parallel.runs`);
    ``on="ef"``: one unit of every selected step, since the error-feedback memories
    carry from step to step.
    """
    check_on(on)
    selection.require_learners(minimum, what)
    usable_scopes(selection.scopes(cap), ratios)
    if on == "ef":
        return [selection.steps]
    return runs(selection.steps, planned_workers(cap, selection, compute.jobs))


def step_sets(
    cap: Capture,
    selection: Selection,
    ratios: Sequence[float],
    on: str,
    steps: Sequence[int],
    compute: Compute,
    *,
    with_mean: bool = True,
) -> Iterator[tuple[int, list[tuple[Scope, float, StepSets]]]]:
    """Yield ``(step, [(scope, ratio, sets), ...])`` at each of ``steps``: the top-k sets
    of every selected learner (and of the mean gradient when ``with_mean``) in each scope
    at every ratio, from one read of the step.

    ``on="raw"``: the recorded gradients, streamed one learner's row (or column block) at
    a time into buffers this walk owns (``topk_stream``; freed when it ends); ``on="ef"``:
    g + m from a top-k residual error-feedback replay at that ratio (``ef_vectors``;
    ``steps`` must then be a run's steps in order). Warns once per scope and ratio when
    a vector has fewer than k non-zeros (the set is then partly arbitrary ties).
    """
    learners = list(selection.learners)
    scopes = usable_scopes(selection.scopes(cap), ratios, warn=False)
    device = compute.torch_device()
    warned: set[tuple[str, float]] = set()
    if on == "ef":
        for step, found in _ef_step_sets(cap, steps, learners, scopes, ratios, device, with_mean):
            yield step, [_warn_sparse(warned, step, *one) for one in found]
        return
    blocks = {sc.name: min(sc.numel, compute.block_numel(sc.numel)) for sc in scopes}
    with SetBuffers(max(blocks.values()), device, with_mean) as buffers:
        for at, step in enumerate(steps):
            found = []
            # one scope: its next step's first row is read while this step ends
            then = steps[at + 1] if len(scopes) == 1 and at + 1 < len(steps) else None
            for sc in scopes:
                ks = [k_for(ratio, sc.numel) for ratio in ratios]
                block = blocks[sc.name]
                sets = stream_step_sets(cap, step, learners, sc, ks, buffers, block, then)
                found += [(sc, ratio, one) for ratio, one in zip(ratios, sets, strict=True)]
            yield step, [_warn_sparse(warned, step, *one) for one in found]


def _ef_step_sets(
    cap: Capture,
    steps: Sequence[int],
    learners: list[int],
    scopes: Sequence[Scope],
    ratios: Sequence[float],
    device: torch.device,
    with_mean: bool,
) -> Iterator[tuple[int, list[tuple[Scope, float, StepSets]]]]:
    """``step_sets`` of ``on="ef"``: the sets of g + m from a top-k residual replay."""
    for step, vectors in ef_vectors(cap, steps, learners, scopes, ratios):
        found = []
        for sc in scopes:
            for ratio in ratios:
                x = vectors[sc.name, ratio].to(device)
                require_finite(step, x, learners, "a top-k set analysis")
                found.append((sc, ratio, _stacked_sets(x, k_for(ratio, sc.numel), with_mean)))
        yield step, found


def _warn_sparse(
    warned: set[tuple[str, float]], step: int, sc: Scope, ratio: float, sets: StepSets
) -> tuple[Scope, float, StepSets]:
    """``(sc, ratio, sets)``, after a warning, once per scope and ratio of a walk
    (``warned``), when some vector has fewer than k non-zeros."""
    key = (sc.name, ratio)
    if sets.sparse and key not in warned:
        warned.add(key)
        warnings.warn(
            f"step {step}, scope {sc.name!r}: fewer than k={sets.k} non-zero entries; "
            "the top-k sets then include arbitrary zeros and overlap is not meaningful",
            GradstatWarning,
            stacklevel=3,
        )
    return sc, ratio, sets


def _stacked_sets(x: torch.Tensor, k: int, with_mean: bool) -> StepSets:
    """The sets of the rows of ``x [n, d]`` already in memory (error-feedback vectors)."""
    indices = topk_indices(x, k)
    sparse = bool((x.gather(1, indices) == 0).any())
    energy = None
    if with_mean:
        mean = x.mean(dim=0)
        indices = torch.cat([indices, topk_indices(mean, k)[None]])
        energy = energy_captured(mean, indices)
    return StepSets(k, x.shape[1], indices, energy, sparse)


@dataclass(frozen=True)
class SimilarityParams:
    """The parameters of a top-k set analysis (similarity's, build-up's): ``ratios``,
    densities k/d of the top-k sets (``"0.01,0.001"``, a number or a sequence; one read
    of each step serves them all); ``on``: ``raw`` or ``ef`` (the error-feedback-corrected
    vectors, :mod:`~gradstat.analysis.ef_vectors`). Defaults: :mod:`gradstat.defaults`."""

    ratios: tuple[float, ...] = defaults.SET_RATIOS
    on: str = defaults.ON

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratios", tuple(parse_ratios(self.ratios)))
        check_on(self.on)


@dataclass(frozen=True)
class SimilarityResult:
    """``pairs``: one row per (step, scope, learner_a, learner_b), ``learner_b`` = "mean"
    for the top-k of the mean gradient; ``steps``: one row per (step, scope); both per
    ratio, in the order of the ratios."""

    pairs: pd.DataFrame
    steps: pd.DataFrame


def similarity(
    cap: Capture,
    selection: Selection | None = None,
    params: SimilarityParams | None = None,
    *,
    compute: Compute | None = None,
    progress: Progress = no_progress,
) -> SimilarityResult:
    """Top-k set similarity between learners and with the mean gradient, per step.

    ``pairs`` columns: step, scope, ratio, k, d, learner_a, learner_b, overlap, jaccard,
    hamming, random_overlap (k/d), energy (E(I_a) of the mean gradient; mean rows only),
    contraction_ok (ScaleCom's condition with learner_a as leader; mean rows only).
    ``steps`` columns: step, scope, ratio, k, d, learners, mean_overlap, min_overlap
    (over learner pairs), mean_overlap_global (learners vs the mean), random_overlap,
    full_intersection, union, buildup, random_buildup, energy_topk (E(I*)), mean_energy,
    leader (CLT-k leader: learner at position step mod n), leader_contraction_ok,
    contraction_breaks (how many learners break the condition as leader).
    Units: runs of steps (``plan_sets``).
    """
    selection = selection or Selection.of(cap)
    params = params or SimilarityParams()
    compute = compute or Compute()
    units = plan_sets(cap, selection, params.ratios, params.on, 2, "similarity", compute)
    task = Task(similarity_unit, str(cap.path), selection, params, parts=None)
    step_records = by_ratio(run_units(cap, task, units, compute, progress), params.ratios)
    pairs = [pair for record in step_records for pair in record.pop("pairs")]
    return SimilarityResult(pd.DataFrame(pairs), pd.DataFrame(step_records))


def by_ratio(records: list[dict], ratios: Sequence[float]) -> list[dict]:
    """``records`` ordered by their ratio's place in ``ratios`` (stable: each ratio's in
    the order they came)."""
    place = {ratio: i for i, ratio in enumerate(ratios)}
    return sorted(records, key=lambda record: place[record["ratio"]])


def similarity_unit(
    cap: Capture,
    selection: Selection,
    params: SimilarityParams,
    compute: Compute,
    steps: Sequence[int],
    *,
    tick: Callable[[], None] = lambda: None,
) -> list[dict]:
    """Records of ``steps``: one per (step, scope, ratio), its pair records under
    ``"pairs"``."""
    n = len(selection.learners)
    records = []
    for step, found in step_sets(cap, selection, params.ratios, params.on, steps, compute):
        for sc, ratio, sets in found:
            intersections, histogram = set_overlaps(sets.indices, n)
            metrics = TopkSetMetrics(
                sets.k, sets.d, sets.indices, intersections, histogram, sets.energy
            )
            records.append(_similarity_record(step, sc.name, ratio, selection.learners, metrics))
        tick()
    return records


def _similarity_record(
    step: int, scope: str, ratio: float, learners: Sequence[int], metrics: TopkSetMetrics
) -> dict:
    """The step record of one (step, scope), with its pair records under ``"pairs"``."""
    n, k, d = len(learners), metrics.k, metrics.d
    base = {"step": step, "scope": scope, "ratio": ratio, "k": k, "d": d}
    over, jac, ham = metrics.overlap, metrics.jaccard, metrics.hamming
    ok = metrics.contraction_ok
    baseline = random_overlap(d, k)
    # learner pairs, then each learner with the mean (b = n), whose rows also carry the
    # energy a's set captures and a's contraction check as CLT-k leader
    pairs = [(a, b) for a in range(n) for b in range(a + 1, n)] + [(a, n) for a in range(n)]
    pair_rows = [
        {
            **base,
            "learner_a": learners[a],
            "learner_b": learners[b] if b < n else "mean",
            "overlap": float(over[a, b]),
            "jaccard": float(jac[a, b]),
            "hamming": int(ham[a, b]),
            "random_overlap": baseline,
            "energy": float(metrics.energy[a]) if b == n else float("nan"),
            "contraction_ok": bool(ok[a]) if b == n else None,
        }
        for a, b in pairs
    ]
    iu = torch.triu_indices(n, n, offset=1)
    pair_overlap = over[:n, :n][iu[0], iu[1]]
    leader = step % n
    return {
        **base,
        "learners": n,
        "mean_overlap": float(pair_overlap.mean()),
        "min_overlap": float(pair_overlap.min()),
        "mean_overlap_global": float(over[:n, n].mean()),
        "random_overlap": baseline,
        "full_intersection": metrics.full_intersection,
        "union": metrics.union,
        "buildup": metrics.union / k,
        "random_buildup": float(random_union(d, k, n)) / k,
        "energy_topk": float(metrics.energy[n]),
        "mean_energy": float(metrics.energy[:n].mean()),
        "leader": learners[leader],
        "leader_contraction_ok": bool(ok[leader]),
        "contraction_breaks": int((~ok).sum()),
        "pairs": pair_rows,
    }


def overlap_matrix(pairs: pd.DataFrame | SimilarityResult) -> pd.DataFrame:
    """Mean overlap (over the steps and scopes in ``pairs``: :func:`similarity`'s result
    or its ``pairs`` table) as a symmetric square table.

    Rows and columns are the learners then "mean" (the top-k of the mean gradient); the
    diagonal is 1.
    """
    if isinstance(pairs, SimilarityResult):
        pairs = pairs.pairs
    means = pairs.groupby(["learner_a", "learner_b"], sort=False)["overlap"].mean()
    learners = list(dict.fromkeys(pairs["learner_a"]))
    names = [*learners, "mean"]
    matrix = pd.DataFrame(1.0, index=names, columns=names)
    for (a, b), value in means.items():
        matrix.loc[a, b] = matrix.loc[b, a] = value
    return matrix


def similarity_summary(steps: pd.DataFrame | SimilarityResult) -> pd.DataFrame:
    """Means over steps per scope and ratio, with the overlap relative to random, of
    :func:`similarity`'s result (or its ``steps`` table)."""
    if isinstance(steps, SimilarityResult):
        steps = steps.steps
    grouped = steps.groupby(["scope", "ratio"], sort=False)
    summary = grouped.agg(
        k=("k", "first"),
        d=("d", "first"),
        steps=("step", "size"),
        mean_overlap=("mean_overlap", "mean"),
        min_overlap=("min_overlap", "min"),
        mean_overlap_global=("mean_overlap_global", "mean"),
        random_overlap=("random_overlap", "first"),
        full_intersection=("full_intersection", "mean"),
        buildup=("buildup", "mean"),
        random_buildup=("random_buildup", "first"),
        energy_topk=("energy_topk", "mean"),
        mean_energy=("mean_energy", "mean"),
        leader_breaks=("leader_contraction_ok", lambda ok: int((~ok.astype(bool)).sum())),
    ).reset_index()
    summary.insert(
        summary.columns.get_loc("random_overlap") + 1,
        "overlap_vs_random",
        summary["mean_overlap"] / summary["random_overlap"],
    )
    return summary
