"""Compare training runs of one workload: dense and compressed, online against replay
(docs/online.md, "gradstat compare", defines every column).

For every run its loss curves; for every run trained with a compression hook, per
recorded step, the relative error of the update its learners applied (**measured**
online, from their ``sent`` rows), of the replay of its compressor over its own ``grad``
rows (**replayed**: the same trajectory, a check of hook and replay) and over the dense
run's (**predicted** open-loop, what ``gradstat replay`` says before anyone trains
compressed), with their bytes, and the first step where prediction and measurement part
by more than ``tolerance`` (``divergence_step``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from gradstat.analysis.replay import capture_plan, trained_options
from gradstat.analysis.replay_block import replicate_stage, scatter
from gradstat.analysis.replay_records import error_sums, ratios
from gradstat.analysis.replay_stream import replay_streamed
from gradstat.analysis.trained_with import check_all_used, replay_spec
from gradstat.compressors.exchange import SparseRow
from gradstat.compressors.registry import Scheme, build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.defaults import DIVERGENCE_TOLERANCE
from gradstat.errors import GradstatWarning, UsageError
from gradstat.store import Capture, open_capture


@dataclass
class Run:
    """One capture's identity and loss curves."""

    path: str
    name: str
    compressor: dict | None
    workload: str
    seed: object
    learners: int
    steps: list[int]
    losses: np.ndarray  # (learners, steps)
    #: The compressor that replays it: the recorded one if built in, else as the user
    #: named it (gradstat/analysis/trained_with.py); None for a dense run.
    spec: str | None = None

    @property
    def label(self) -> str:
        if self.compressor is None:
            return "dense"
        ratio = self.compressor["ratio"]
        return self.compressor["name"] + ("" if ratio is None else f" at {ratio:g}")


@dataclass
class Comparison:
    """What ``gradstat compare`` shows: runs, loss curves, and online against replay."""

    runs: list[Run]
    losses: pd.DataFrame
    errors: pd.DataFrame
    summary: pd.DataFrame
    dense: str | None
    tolerance: float = DIVERGENCE_TOLERANCE
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "runs": [
                {
                    "path": r.path,
                    "label": r.label,
                    "compressor": r.compressor,
                    "workload": r.workload,
                    "seed": r.seed,
                    "learners": r.learners,
                    "steps": r.steps,
                    "loss_mean": r.losses.mean(axis=0).tolist(),
                    "loss_per_learner": r.losses.tolist(),
                }
                for r in self.runs
            ],
            "dense_run": self.dense,
            "divergence_tolerance": self.tolerance,
            "summary": _records(self.summary),
            "errors": _records(self.errors),
            "notes": self.notes,
        }


def _records(frame: pd.DataFrame) -> list[dict]:
    return [
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        for row in frame.to_dict(orient="records")
    ]


def _run(cap: Capture, path: str, given: Mapping[str, str]) -> Run:
    recorded = cap.compressor
    return Run(
        path=path,
        name=Path(path).name,
        compressor=recorded,
        workload=cap.workload,
        seed=cap.meta.get("seed"),
        learners=cap.world_size,
        steps=[int(s) for s in cap.steps],
        losses=cap.losses,
        spec=replay_spec(path, None if recorded is None else recorded["name"], given),
    )


def _scheme(cap: Capture, run: Run, plan_from: Capture) -> Scheme:
    """The replay of ``run``'s compressor (its spec: the built-in the capture recorded, or
    the class named with ``--trained-with``) over ``cap``, on the plan the compressed run
    ``plan_from`` trained with (gradstat/hooks/compression.py records it)."""
    assert run.compressor is not None and run.spec is not None
    spec = parse_compressors(run.spec)[0]
    scope = cap.scopes("model")[0]
    plan = capture_plan(cap, scope, **trained_options(plan_from))
    # the run's --seed seeded the hook's random draws (QSGD, TernGrad, a user's class)
    seed = int(cap.meta.get("seed") or 0)
    return build_scheme(spec, run.compressor["ratio"], plan, seed=seed)


def _rel_error(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    """``||e - r||^2 / ||r||^2`` as the replay's records take it (NaN for r = 0)."""
    return ratios(error_sums(estimate, reference))[0]


def _whole(scheme: Scheme, parts: Sequence[torch.Tensor | SparseRow]) -> torch.Tensor:
    """One flat row from each message's flat part (dense or sparse), in layer order."""
    stop = max(offset + numel for m in scheme.plan.messages for offset, numel in m.slices)
    row = torch.zeros(stop)
    for message, part in zip(scheme.plan.messages, parts, strict=True):
        scatter(row, message.slices, part)
    return row


def _parts(scheme: Scheme, rows: torch.Tensor) -> list[torch.Tensor]:
    """Each message's columns of ``rows[..., numel]``, in message order."""
    return [
        torch.cat([rows[..., o : o + k] for o, k in m.slices], dim=-1) for m in scheme.plan.messages
    ]


def _applied(scheme: Scheme, sent: torch.Tensor, step: int) -> torch.Tensor:
    """The update the learners applied: per message, the compressor's aggregate of their
    sent rows (their sum, or its own such as signSGD's majority vote), divided by their
    number when it averages; a message sent dense, their mean. An HSDP unit's message
    (``replicate`` shard groups of consecutive learners) is aggregated in each group and
    the groups' updates averaged, as FSDP's replicate all-reduce does; where gradstat
    compressed that stage (``sent`` records stage 1 only) the groups' updates go through
    the replay's :func:`~gradstat.analysis.replay_block.replicate_stage` (``scheme``'s
    own memory of it) at recorded ``step``."""
    n = sent.shape[0]
    parts = []
    for m, part in enumerate(_parts(scheme, sent)):
        size = n // scheme.plan.messages[m].replicate
        groups = [part[first : first + size] for first in range(0, n, size)]
        if scheme.plan.messages[m].dense:
            updates = [group.mean(dim=0) for group in groups]
        else:
            compressor = scheme.compressor(0, m)
            totals = [compressor.aggregate(list(group)).reshape(-1) for group in groups]
            updates = [total / size if compressor.average else total for total in totals]
        if scheme.plan.messages[m].replicate_compressed:
            parts.append(replicate_stage(scheme, m, updates, size, step)[0])
        else:
            parts.append(sum(updates[1:], updates[0]) / len(updates))
    return _whole(scheme, parts)


def _reference(scheme: Scheme, grads: torch.Tensor) -> torch.Tensor:
    """The dense update each message is judged against (DGC: the momentum update)."""
    means = _parts(scheme, grads.mean(dim=0))
    return _whole(scheme, [scheme.reference(m, mean) for m, mean in enumerate(means)])


def _replayed(cap: Capture, scheme: Scheme, steps: Sequence[int]) -> Iterator[tuple]:
    """``(estimate, bytes per learner)`` of the streamed replay of ``scheme`` over
    ``steps`` of ``cap`` (scope ``model``)."""
    scope = cap.scopes("model")[0]
    for _, (result,) in replay_streamed(cap, steps, cap.learners, [(scope, scheme)]):
        by_message = sorted(result.messages, key=lambda outcome: outcome.index)
        estimate = _whole(scheme, [outcome.estimate for outcome in by_message])
        yield estimate, sum(t.nbytes for o in by_message for t in o.transfers)


def _online_errors(cap: Capture, run: Run, steps: Sequence[int]) -> list[dict]:
    """Measured and self-replayed error and bytes of one compressed run, per step."""
    measured_scheme = _scheme(cap, run, cap)
    replayed = _scheme(cap, run, cap)
    rows = []
    outcomes = _replayed(cap, replayed, steps)
    for i, step in enumerate(steps):
        grads = cap.read_step(step)
        sent = cap.read_step(step, dataset="sent")
        reference = _reference(measured_scheme, grads)
        applied = _applied(measured_scheme, sent, int(step))
        estimate, sent_bytes = next(outcomes)
        rows.append(
            {
                "step": int(step),
                "granularity": replayed.plan.granularity,
                "memory": replayed.memory_label,
                "measured_rel_error": _rel_error(applied, reference),
                "measured_bytes": float(cap.sent_bytes[:, i].mean()),
                "replayed_rel_error": _rel_error(estimate, reference),
                "replayed_bytes": sent_bytes,
            }
        )
    return rows


def _predicted(
    dense_run: Capture, run: Run, run_cap: Capture, steps: Sequence[int]
) -> dict[int, dict]:
    """The open-loop replay of ``run``'s compressor and plan (``run_cap``'s) over the
    dense run's gradients."""
    scheme = _scheme(dense_run, run, run_cap)
    out = {}
    outcomes = _replayed(dense_run, scheme, steps)
    for step, grads in dense_run.iter_steps(steps):
        reference = _reference(scheme, grads)
        estimate, sent_bytes = next(outcomes)
        out[step] = {
            "predicted_rel_error": _rel_error(estimate, reference),
            "predicted_bytes": sent_bytes,
        }
    return out


def compare(
    paths: Sequence[str | Path],
    tolerance: float = DIVERGENCE_TOLERANCE,
    trained_with: Mapping[str, str] | None = None,
) -> Comparison:
    """Compare the runs at ``paths`` (see the module docstring). ``trained_with``: the
    compressor of a run trained with a user's class, ``{resolved path: spec}``
    (:func:`~gradstat.analysis.trained_with.parse_trained_with`); a capture's own record
    of such a class is never imported."""
    if len(paths) < 2:
        raise UsageError("compare needs at least two runs")
    if not tolerance > 0:
        raise UsageError(f"--tolerance must be positive, got {tolerance}")
    given = dict(trained_with or {})
    check_all_used(given, paths)
    caps: list[Capture] = []
    try:
        for p in paths:
            caps.append(open_capture(p))
        runs = [_run(cap, str(p), given) for cap, p in zip(caps, paths, strict=True)]
        notes = _check_same_training(runs, caps)
        dense_index = next((i for i, r in enumerate(runs) if r.compressor is None), None)
        dense = None if dense_index is None else (caps[dense_index], runs[dense_index])
        rows = [
            row
            for cap, run in zip(caps, runs, strict=True)
            if run.compressor is not None
            for row in _error_rows(cap, run, dense)
        ]
        errors = pd.DataFrame(rows, columns=_ERROR_COLUMNS)
        if dense is None and len(errors):
            notes.append("no dense run among the runs: no open-loop prediction")
        return Comparison(
            runs=runs,
            losses=_losses(runs),
            errors=errors,
            summary=_summary(runs, errors, tolerance),
            dense=None if dense is None else dense[1].name,
            tolerance=tolerance,
            notes=notes,
        )
    finally:
        for cap in caps:
            cap.close()


def _losses(runs: list[Run]) -> pd.DataFrame:
    """One row per run, learner and recorded step: the learner's training loss."""
    return pd.DataFrame(
        [
            {"run": r.name, "label": r.label, "step": s, "learner": learner, "loss": v}
            for r in runs
            for learner in range(r.learners)
            for s, v in zip(r.steps, r.losses[learner], strict=True)
        ]
    )


def _error_rows(cap: Capture, run: Run, dense: tuple[Capture, Run] | None) -> list[dict]:
    """One row per recorded step of a compressed ``run``: the error of what its learners
    sent (online), and where a ``dense`` run (its capture and summary) is given, the error
    and bytes replaying ``run``'s compressor over the dense gradients predicts (open loop)."""
    if not cap.has_sent:
        raise UsageError(f"{run.path}: names a compressor but holds no sent rows")
    predicted: dict[int, dict] = {}
    if dense is not None:
        dense_cap, dense_run = dense
        if dense_cap.numel != cap.numel:
            raise UsageError(f"{run.path} and {dense_run.path} train different models")
        common = [s for s in run.steps if s in set(dense_run.steps)]
        predicted = _predicted(dense_cap, run, cap, common)
    missing = {"predicted_rel_error": math.nan, "predicted_bytes": math.nan}
    return [
        {"run": run.name, "label": run.label, **row, **predicted.get(row["step"], missing)}
        for row in _online_errors(cap, run, run.steps)
    ]


_ERROR_COLUMNS = [
    "run",
    "label",
    "step",
    "granularity",
    "memory",
    "measured_rel_error",
    "measured_bytes",
    "replayed_rel_error",
    "replayed_bytes",
    "predicted_rel_error",
    "predicted_bytes",
]


def _check_same_training(runs: list[Run], caps: list[Capture]) -> list[str]:
    """Warn when the runs do not share workload, seed and model: curves then differ for
    other reasons than compression."""
    notes = []
    first = runs[0]
    for run, cap in zip(runs[1:], caps[1:], strict=True):
        if run.workload != first.workload or run.seed != first.seed or cap.numel != caps[0].numel:
            message = (
                f"{run.name} ({run.workload}, seed {run.seed}, {cap.numel:,} parameters) and "
                f"{first.name} ({first.workload}, seed {first.seed}, {caps[0].numel:,}) are "
                "not the same training"
            )
            warnings.warn(message, GradstatWarning, stacklevel=3)
            notes.append(message)
    return notes


def _divergence(errors: pd.DataFrame, tolerance: float) -> float:
    gap = (errors["predicted_rel_error"] - errors["measured_rel_error"]).abs()
    over = errors["step"][gap > tolerance * errors["measured_rel_error"].abs()]
    return float(over.iloc[0]) if len(over) else math.nan


def _summary(runs: list[Run], errors: pd.DataFrame, tolerance: float) -> pd.DataFrame:
    rows = []
    for run in runs:
        mean = run.losses.mean(axis=0)
        row = {
            "run": run.name,
            "label": run.label,
            "steps": len(run.steps),
            "loss_first": float(mean[0]) if mean.size else math.nan,
            "loss_last": float(mean[-1]) if mean.size else math.nan,
            "loss_min": float(mean.min()) if mean.size else math.nan,
        }
        mine = errors[errors["run"] == run.name]
        for column in ("granularity", "memory"):  # the plan and memory it was replayed on
            row[column] = str(mine[column].iloc[0]) if len(mine) else None
        for column in _ERROR_COLUMNS[5:]:
            row[column] = float(mine[column].mean()) if len(mine) else math.nan
        row["divergence_step"] = _divergence(mine, tolerance) if len(mine) else math.nan
        rows.append(row)
    return pd.DataFrame(rows)
