"""``gradstat similarity``, ``gradstat buildup`` and ``gradstat overlap``: top-k index sets
across learners and over time (ScaleCom, arXiv 2104.11125; docs/methods.md 3)."""

from __future__ import annotations

from typing import Annotated

import pandas as pd
import typer

from gradstat.analysis.buildup import BuildupParams, buildup, buildup_summary
from gradstat.analysis.overlap import OverlapParams, overlap, overlap_summary
from gradstat.analysis.selection import Selection
from gradstat.analysis.similarity import (
    SimilarityParams,
    overlap_matrix,
    similarity,
    similarity_summary,
)
from gradstat.cli.options import (
    DPI,
    RATIOS,
    SET_RATIOS,
    Capture,
    Csv,
    Detail,
    Device,
    Dpi,
    Jobs,
    Json,
    Learners,
    Memory,
    On,
    OnVectors,
    Plot,
    Ratios,
    Scope,
    Steps,
    between,
    compute_options,
)
from gradstat.cli.output import Output, Result, View, note_sample, progress, show
from gradstat.defaults import LAG, ON
from gradstat.errors import UsageError
from gradstat.report.answers import buildup_answer, overlap_answer, similarity_answer
from gradstat.store import open_capture

Lag = Annotated[
    int,
    typer.Option(
        "--lag", callback=between(1), help="Compare each recorded step with the one LAG rows on."
    ),
]
#: The vectors whose sets are taken, by default (raw gradients).
VECTORS = On(ON)
#: Learners up to which the overlap matrix is part of the default output.
MATRIX_SHOWN = 8


def _selection(cap, steps, learners, scope, minimum: int, what: str) -> Selection:
    if len(cap.learners) < minimum:
        raise UsageError(
            f"{what} compares learners' top-k sets and needs at least {minimum} learners; "
            f"{cap.path} recorded {len(cap.learners)} of {cap.world_size}"
        )
    selection = Selection.of(cap, steps, learners, scope)
    selection.require_learners(minimum, what)
    return selection


def similarity_command(
    capture: Capture,
    ratios: Ratios = SET_RATIOS,
    on: OnVectors = VECTORS,
    scope: Scope = "model",
    steps: Steps = None,
    learners: Learners = None,
    as_json: Json = False,
    csv: Csv = None,
    detail: Detail = False,
    plot: Plot = None,
    dpi: Dpi = DPI,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """How similar the learners' top-k sets are, to each other and to the mean's.

    Overlap and Jaccard of learners' top-k sets, with each other and with the top-k of
    the mean gradient; energy captured, ScaleCom's contraction check, random baseline.

    Example: gradstat similarity captures/lm --ratios 0.001 --plot similarity.png
    """
    with open_capture(capture) as cap:
        note_sample(cap)
        result = similarity(
            cap,
            _selection(cap, steps, learners, scope, 2, "similarity"),
            SimilarityParams(ratios, on.value),
            compute=compute_options(device, memory, jobs),
            progress=lambda units: progress(units, "similarity"),
        )
    shown = similarity_result(result.pairs, result.steps, on.value)
    last = result.pairs[result.pairs["ratio"] == ratios[-1]]
    shown.figure = lambda: _plot("plot_similarity", last)
    show(shown, Output(as_json, csv, detail, plot, dpi))


def similarity_result(pairs: pd.DataFrame, per_step: pd.DataFrame, on: str) -> Result:
    """The similarity tables: the overlap matrix at the smallest ratio (in the summary
    while it has at most ``MATRIX_SHOWN`` learners, else in the detail), the means over
    steps, and the per-step table as detail; ``on`` names the vectors (raw or ef)."""
    summary = similarity_summary(per_step)
    matrix_view = _matrix_view(pairs)
    shown = [matrix_view] if len(matrix_view.rows) <= MATRIX_SHOWN else []
    return Result(
        pairs,
        summary=[*shown, _summary_view(summary, per_step["step"].nunique(), on)],
        answer=similarity_answer(summary),
        detail=[*([] if shown else [matrix_view]), _per_step_view(per_step)],
        document={
            "records": pairs.to_dict(orient="records"),
            "steps": per_step.to_dict(orient="records"),
            "summary": summary.to_dict(orient="records"),
        },
    )


def _matrix_view(pairs: pd.DataFrame) -> View:
    """The learners' mean overlap matrix at the smallest ratio, the mean gradient's too."""
    matrix = overlap_matrix(pairs[pairs["ratio"] == pairs["ratio"].min()])
    table = matrix.reset_index(names="learner")
    table.columns = [str(c) for c in table.columns]
    table["learner"] = table["learner"].astype(str)
    return View(
        f"mean overlap matrix at ratio {pairs['ratio'].min():g} ('mean': the mean gradient's)",
        table,
    )


def _summary_view(summary: pd.DataFrame, steps: int, on: str) -> View:
    """The similarity means over ``steps`` steps, per scope and ratio."""
    return View(
        f"top-k similarity, mean over {steps} steps (on {on})",
        summary,
        {
            "scope": "scope",
            "ratio": "ratio",
            "mean_overlap": "overlap",
            "mean_overlap_global": "vs mean",
            "overlap_vs_random": "x random",
            "buildup": "B",
            "random_buildup": "B random",
            "leader_breaks": "CLT breaks",
        },
        "overlap = |A n B| / k between learners; vs mean = with the mean gradient's "
        "top-k; x random = overlap / k/d; B = union / k; CLT breaks = steps whose "
        "leader breaks ScaleCom's contraction check.",
    )


def _per_step_view(per_step: pd.DataFrame) -> View:
    """The similarity of each step, scope and ratio."""
    return View(
        "top-k similarity per step",
        per_step,
        {
            "step": "step",
            "scope": "scope",
            "ratio": "ratio",
            "mean_overlap": "overlap",
            "mean_overlap_global": "vs mean",
            "full_intersection": "all n",
            "buildup": "B",
            "energy_topk": "E(I*)",
            "leader_contraction_ok": "CLT",
        },
        "all n = full intersection / k; E(I*) = energy of the mean's top-k; CLT = "
        "ScaleCom's contraction check for leader step mod n.",
    )


def buildup_command(
    capture: Capture,
    ratios: Ratios = RATIOS,
    on: OnVectors = VECTORS,
    scope: Scope = "model",
    steps: Steps = None,
    learners: Learners = None,
    as_json: Json = False,
    csv: Csv = None,
    detail: Detail = False,
    plot: Plot = None,
    dpi: Dpi = DPI,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """How large the union of the learners' top-k sets grows (gradient build-up).

    B(m) = E|union of m learners' top-k| / k for m = 1..n (exact mean over learner
    orders) against random sets, and the all-gather's effective density.

    Example: gradstat buildup captures/lm --ratios 0.01,0.001 --plot buildup.png
    """
    with open_capture(capture) as cap:
        note_sample(cap)
        records = buildup(
            cap,
            _selection(cap, steps, learners, scope, 2, "build-up"),
            BuildupParams(ratios, on.value),
            compute=compute_options(device, memory, jobs),
            progress=lambda units: progress(units, "build-up"),
        )
    result = buildup_result(records, on.value)
    result.figure = lambda: _plot("plot_buildup", records)
    show(result, Output(as_json, csv, detail, plot, dpi))


def _doubling(m: pd.Series) -> pd.Series:
    """m = 1, 2, 4, 8, ... and the largest m: the rows of a long B(m) table shown first."""
    top = m.max()
    return (m == top) | ((m & (m - 1)) == 0)


def buildup_result(records: pd.DataFrame, on: str) -> Result:
    summary = buildup_summary(records)
    columns = {
        "scope": "scope",
        "ratio": "ratio",
        "k": "k",
        "m": "m",
        "buildup": "B",
        "buildup_max": "B max",
        "random_buildup": "B random",
        "density": "U/d",
        "allgather_vs_allreduce": "vs dense",
    }
    note = "U/d: density after an all-gather; vs dense: its bytes over a dense ring all-reduce's."
    title = f"build-up B(m) = E[U(m)] / k, mean over {records['step'].nunique()} steps (on {on})"
    long = summary["m"].max() > MATRIX_SHOWN
    shown = summary[_doubling(summary["m"])] if long else summary
    return Result(
        records,
        summary=[View(title, shown, columns, note + (" m = 1, 2, 4, ... n." if long else ""))],
        answer=buildup_answer(summary),
        detail=[
            *([View(f"{title}, every m", summary, columns)] if long else []),
            _buildup_per_step(records),
        ],
        document={
            "records": records.to_dict(orient="records"),
            "summary": summary.to_dict(orient="records"),
        },
    )


def _buildup_per_step(records: pd.DataFrame) -> View:
    """B(m) of each step, one column per m from 2 (m = 2, 4, 8, ... and n beyond
    ``MATRIX_SHOWN`` learners)."""
    keep = records["m"] > 1
    if records["m"].max() > MATRIX_SHOWN:
        keep &= _doubling(records["m"])
    rows = records[keep]
    wide = rows.pivot_table(
        index=["step", "scope", "ratio"], columns="m", values="buildup", sort=False
    )
    wide.columns = [f"B({m})" for m in wide.columns]
    return View(
        "build-up per step: B(m) = U(m) / k of m learners",
        wide.reset_index(),
        note="U(m): the union of m learners' top-k sets, mean over learner orders.",
        keys=3,
    )


def overlap_command(
    capture: Capture,
    ratios: Ratios = SET_RATIOS,
    lag: Lag = LAG,
    on: OnVectors = VECTORS,
    scope: Scope = "model",
    steps: Steps = None,
    learners: Learners = None,
    as_json: Json = False,
    csv: Csv = None,
    detail: Detail = False,
    plot: Plot = None,
    dpi: Dpi = DPI,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """How stable top-k sets are from one recorded step to the next.

    Overlap of top-k sets between recorded step t and t + lag, per learner and for the
    mean gradient; each row states the real training-step gap.

    Example: gradstat overlap captures/lm --lag 1 --plot overlap.png
    """
    with open_capture(capture) as cap:
        note_sample(cap)
        records = overlap(
            cap,
            _selection(cap, steps, learners, scope, 1, "overlap"),
            OverlapParams(ratios, lag, on.value),
            compute=compute_options(device, memory, jobs),
            progress=lambda units: progress(units, "overlap"),
        )
    result = overlap_result(records, lag, on.value)
    result.figure = lambda: _plot("plot_overlap", records[records["ratio"] == ratios[-1]])
    show(result, Output(as_json, csv, detail, plot, dpi))


def _two_rows(summary: pd.DataFrame) -> pd.DataFrame:
    """Many learners: their mean as one row ('learners') and the mean gradient's row."""
    is_mean = summary["learner"].astype(str) == "mean"
    keys = ["scope", "ratio"]
    learners = (
        summary[~is_mean]
        .groupby(keys, sort=False)
        .agg(
            pairs=("pairs", "first"),
            gap_max=("gap_max", "max"),
            mean_overlap=("mean_overlap", "mean"),
            min_overlap=("min_overlap", "min"),
            mean_jaccard=("mean_jaccard", "mean"),
        )
        .reset_index()
        .assign(learner="learners")
    )
    return pd.concat([learners, summary[is_mean]], ignore_index=True)


def overlap_result(records: pd.DataFrame, lag: int, on: str) -> Result:
    summary = overlap_summary(records)
    keys = ["scope", "ratio", "step", "next_step", "gap"]
    wide = records.pivot_table(index=keys, columns="learner", values="overlap", sort=False)
    wide.columns = [str(c) for c in wide.columns]
    wide = wide.reset_index().rename(columns={"next_step": "next"})
    shown = summary if summary["learner"].nunique() <= MATRIX_SHOWN + 1 else _two_rows(summary)
    return Result(
        records,
        summary=[
            View(
                f"overlap of top-k(t) and top-k(t + lag {lag}), mean over step pairs (on {on})",
                shown,
                {
                    "scope": "scope",
                    "ratio": "ratio",
                    "learner": "learner",
                    "pairs": "pairs",
                    "gap_max": "max gap",
                    "mean_overlap": "overlap",
                    "min_overlap": "min",
                    "mean_jaccard": "jaccard",
                },
                "max gap: the largest training-step gap between the compared recorded steps.",
            )
        ],
        answer=overlap_answer(summary),
        detail=[
            *([] if shown is summary else [View("overlap per learner", summary)]),
            View("overlap per step pair, per learner and for the mean gradient", wide),
        ],
        document={
            "records": records.to_dict(orient="records"),
            "summary": summary.to_dict(orient="records"),
        },
    )


def _plot(name: str, table: pd.DataFrame):
    from gradstat.plots import similarity as plots

    return getattr(plots, name)(table)
