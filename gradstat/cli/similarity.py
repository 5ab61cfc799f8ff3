"""``gradstat similarity``, ``gradstat buildup`` and ``gradstat overlap``: top-k index sets
across learners and over time (ScaleCom, arXiv 2104.11125; docs/methods.md 3)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import pandas as pd
import typer

from gradstat.analysis.buildup import BuildupParams, buildup, buildup_summary
from gradstat.analysis.overlap import OverlapParams, overlap_summary, temporal_overlap
from gradstat.analysis.selection import Selection
from gradstat.analysis.similarity import (
    SimilarityParams,
    overlap_matrix,
    similarity,
    similarity_summary,
)
from gradstat.cli.options import (
    CaptureArg,
    CsvOpt,
    Device,
    DpiOpt,
    Jobs,
    JsonOpt,
    LearnersOpt,
    Memory,
    PlotOpt,
    ScopeOpt,
    StepsOpt,
    compute_options,
)
from gradstat.cli.output import df_table, emit, note_sample, progress
from gradstat.errors import UsageError
from gradstat.plots.paths import check_plot_path
from gradstat.store import Capture, open_capture


class On(str, Enum):
    """Which vectors the top-k sets are taken of."""

    raw = "raw"
    ef = "ef"


RatioOpt = typer.Option(0.001, "--ratio", help="Density k/d of the top-k sets.")
OnOpt = typer.Option(
    On.raw,
    "--on",
    help="raw: the recorded gradients; ef: g + memory of a top-k error-feedback replay "
    "over consecutive recorded steps (what the compressor sees).",
)


def _select(
    cap: Capture, steps: str | None, learners: str | None, scope: str, minimum: int, what: str
) -> Selection:
    if len(cap.learners) < minimum:
        raise UsageError(
            f"{what} compares learners' top-k sets and needs at least {minimum} learners; "
            f"{cap.path} recorded {len(cap.learners)} of {cap.world_size}"
        )
    return Selection.of(cap, steps, learners, scope)


def _records(df: pd.DataFrame) -> list[dict]:
    return df.to_dict(orient="records")


def _table(df: pd.DataFrame, title: str, columns: dict[str, str]):
    """A rich table of the chosen columns under short headers (fits 80 columns)."""
    return df_table(df[list(columns)].rename(columns=columns), title)


def similarity_command(
    capture: Path = CaptureArg,
    ratio: float = RatioOpt,
    on: On = OnOpt,
    scope: str = ScopeOpt,
    steps: str | None = StepsOpt,
    learners: str | None = LearnersOpt,
    as_json: bool = JsonOpt,
    csv: Path | None = CsvOpt,
    plot: Path | None = PlotOpt,
    dpi: int = DpiOpt,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """Overlap and Jaccard of learners' top-k sets, with each other and with the top-k of
    the mean gradient; energy captured, ScaleCom's contraction check, random baseline."""
    params = SimilarityParams(ratio, on.value)
    compute = compute_options(device, memory, jobs)
    check_plot_path(plot)
    with open_capture(capture) as cap:
        note_sample(cap)
        selection = _select(cap, steps, learners, scope, 2, "similarity")
        result = similarity(
            cap,
            selection,
            params,
            compute=compute,
            progress=lambda items: progress(items, "similarity"),
        )
    summary = similarity_summary(result.steps)
    matrix = overlap_matrix(result.pairs)
    matrix_table = matrix.reset_index(names="learner")
    matrix_table.columns = [str(c) for c in matrix_table.columns]
    matrix_table["learner"] = matrix_table["learner"].astype(str)
    note = f"ratio {ratio:g}, on {on.value}"
    random = float(result.steps["random_overlap"].mean())
    tables = [
        _table(
            result.steps,
            f"top-k similarity per step ({note}): overlap = |A n B| / k between learners, "
            f"vs mean = with the mean gradient's top-k (random {random:.3g}); all n = full "
            "intersection / k; B = union / k; E(I*) = energy of the mean's top-k; CLT = "
            "ScaleCom's contraction check for leader step mod n",
            {
                "step": "step",
                "scope": "scope",
                "k": "k",
                "mean_overlap": "overlap",
                "mean_overlap_global": "vs mean",
                "full_intersection": "all n",
                "buildup": "B",
                "energy_topk": "E(I*)",
                "leader_contraction_ok": "CLT",
            },
        ),
        df_table(matrix_table, "mean overlap matrix ('mean' = top-k of the mean gradient)"),
        _table(
            summary,
            f"mean over {result.steps['step'].nunique()} steps ({note}); x random = "
            "overlap / random; CLT breaks = steps whose leader breaks the check",
            {
                "scope": "scope",
                "mean_overlap": "overlap",
                "mean_overlap_global": "vs mean",
                "overlap_vs_random": "x random",
                "buildup": "B",
                "random_buildup": "B random",
                "leader_breaks": "CLT breaks",
            },
        ),
    ]
    emit(
        result.pairs,
        as_json=as_json,
        csv=csv,
        tables=tables,
        json_document={
            "records": _records(result.pairs),
            "steps": _records(result.steps),
            "summary": _records(summary),
        },
    )
    if plot is not None:
        from gradstat.plots.similarity import plot_similarity
        from gradstat.plots.style import save_figure

        save_figure(plot_similarity(result.pairs), plot, dpi=dpi)


def buildup_command(
    capture: Path = CaptureArg,
    ratios: str = typer.Option("0.01,0.001", "--ratios", help="Densities k/d, comma-separated."),
    on: On = OnOpt,
    scope: str = ScopeOpt,
    steps: str | None = StepsOpt,
    learners: str | None = LearnersOpt,
    as_json: bool = JsonOpt,
    csv: Path | None = CsvOpt,
    plot: Path | None = PlotOpt,
    dpi: int = DpiOpt,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """Gradient build-up B(m) = E|union of m learners' top-k| / k for m = 1..n (exact mean
    over learner orders) against random sets, and the all-gather's effective density."""
    params = BuildupParams(ratios, on.value)
    compute = compute_options(device, memory, jobs)
    check_plot_path(plot)
    with open_capture(capture) as cap:
        note_sample(cap)
        selection = _select(cap, steps, learners, scope, 2, "build-up")
        records = buildup(
            cap,
            selection,
            params,
            compute=compute,
            progress=lambda items: progress(items, "build-up"),
        )
    summary = buildup_summary(records)
    table = _table(
        summary,
        f"build-up B(m) = E[U(m)] / k, mean over {records['step'].nunique()} steps "
        f"(on {on.value}); U/d: density after an all-gather; vs dense: its bytes over a "
        "dense ring all-reduce's",
        {
            "scope": "scope",
            "ratio": "ratio",
            "k": "k",
            "m": "m",
            "buildup": "B",
            "buildup_max": "B max",
            "random_buildup": "B random",
            "density": "U/d",
            "allgather_vs_allreduce": "vs dense",
        },
    )
    emit(
        records,
        as_json=as_json,
        csv=csv,
        tables=[table],
        json_document={"records": _records(records), "summary": _records(summary)},
    )
    if plot is not None:
        from gradstat.plots.similarity import plot_buildup
        from gradstat.plots.style import save_figure

        save_figure(plot_buildup(records), plot, dpi=dpi)


def overlap_command(
    capture: Path = CaptureArg,
    ratio: float = RatioOpt,
    lag: int = typer.Option(
        1, "--lag", min=1, help="Compare each selected recorded step with the one LAG rows on."
    ),
    on: On = OnOpt,
    scope: str = ScopeOpt,
    steps: str | None = StepsOpt,
    learners: str | None = LearnersOpt,
    as_json: bool = JsonOpt,
    csv: Path | None = CsvOpt,
    plot: Path | None = PlotOpt,
    dpi: int = DpiOpt,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """Temporal stability: overlap of top-k sets between recorded step t and t + lag, per
    learner and for the mean gradient; each row states the real training-step gap."""
    params = OverlapParams(ratio, lag, on.value)
    compute = compute_options(device, memory, jobs)
    check_plot_path(plot)
    with open_capture(capture) as cap:
        note_sample(cap)
        selection = _select(cap, steps, learners, scope, 1, "overlap")
        records = temporal_overlap(
            cap,
            selection,
            params,
            compute=compute,
            progress=lambda items: progress(items, "overlap"),
        )
    summary = overlap_summary(records)
    keys = ["scope", "step", "next_step", "gap"]
    wide = records.pivot_table(index=keys, columns="learner", values="overlap", sort=False)
    wide.columns = [str(c) for c in wide.columns]
    wide = wide.reset_index().rename(columns={"next_step": "next"})
    gaps = records["gap"]
    gap = f"{gaps.min()}" if gaps.min() == gaps.max() else f"{gaps.min()} to {gaps.max()}"
    note = (
        f"ratio {ratio:g}, k {records['k'].iloc[0]}, random k/d "
        f"{records['random_overlap'].iloc[0]:.3g}, on {on.value}"
    )
    tables = [
        df_table(
            wide,
            f"overlap of top-k(t) and top-k(t + lag {lag}) per learner and for the mean "
            f"gradient, training-step gap {gap} ({note})",
        ),
        _table(
            summary,
            "mean over step pairs",
            {
                "scope": "scope",
                "learner": "learner",
                "pairs": "pairs",
                "mean_overlap": "overlap",
                "min_overlap": "min",
                "mean_jaccard": "jaccard",
            },
        ),
    ]
    emit(
        records,
        as_json=as_json,
        csv=csv,
        tables=tables,
        json_document={"records": _records(records), "summary": _records(summary)},
    )
    if plot is not None:
        from gradstat.plots.similarity import plot_overlap
        from gradstat.plots.style import save_figure

        save_figure(plot_overlap(records), plot, dpi=dpi)
