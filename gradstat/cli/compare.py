"""``gradstat compare``: dense and compressed runs of one workload side by side, and the
replay's prediction against what the compression hook measured online."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gradstat.cli.options import DPI, Csv, Dpi, Json, Plot, TrainedWith
from gradstat.cli.output import Output, Result, View, show, warn
from gradstat.defaults import DIVERGENCE_TOLERANCE

if TYPE_CHECKING:  # pandas loads with the analysis, when the command runs
    import pandas as pd

Runs = Annotated[
    list[Path],
    typer.Argument(
        metavar="RUN",
        help="Capture folders of the same workload and seed: dense and --compressor runs.",
        show_default=False,
    ),
]
Tolerance = Annotated[
    float,
    typer.Option(
        "--tolerance",
        help="Relative gap between predicted and measured error that counts as divergence.",
    ),
]

_LOSS_COLUMNS = {
    "run": "run",
    "label": "compressor",
    "steps": "steps",
    "loss_first": "loss first",
    "loss_last": "loss last",
    "loss_min": "loss min",
}
_ERROR_COLUMNS = {
    "run": "run",
    "measured_rel_error": "online err",
    "replayed_rel_error": "own replay",
    "predicted_rel_error": "open-loop",
    "measured_bytes": "bytes",
    "predicted_bytes": "predicted",
    "divergence_step": "diverges",
}


def _integer(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def compare_command(
    runs: Runs,
    tolerance: Tolerance = DIVERGENCE_TOLERANCE,
    trained_with: TrainedWith = None,
    as_json: Json = False,
    csv: Csv = None,
    plot: Plot = None,
    dpi: Dpi = DPI,
) -> None:
    """Dense and compressed runs of one training side by side.

    Loss curves of dense and compressed runs; for each compressed run the relative error
    and bytes per step measured online (from its grad and sent rows), the replay over its
    own gradients, and the replay's open-loop prediction over the dense run's gradients,
    with the step where prediction and measurement part. A run trained with your own
    compressor (docs/compressors.md) is replayed with the class you name in
    --trained-with RUN=SPEC: a capture is data, and gradstat runs no code it names.

    Example: gradstat compare captures/lm captures/lm-topk --plot compare.png
    """
    from gradstat.analysis.compare import compare
    from gradstat.analysis.trained_with import parse_trained_with

    given = parse_trained_with(trained_with)
    result = compare([str(r) for r in runs], tolerance, given)
    _warn_unlike(result.runs)

    def figure():
        from gradstat.plots.compare import plot_compare

        return plot_compare(result.losses, result.errors)

    views = _views(result.summary, result.dense, tolerance)
    shown_result = Result(result.errors, summary=views, document=result.to_dict(), figure=figure)
    show(shown_result, Output(as_json, csv, False, plot, dpi))


def _warn_unlike(runs) -> None:
    """Warn when runs differ in learners or recorded steps: their tables and curves then
    compare unlike things (workload, seed and model: the analysis warns)."""
    first = runs[0]
    for run in runs[1:]:
        if run.learners != first.learners:
            warn(
                f"{run.name} trained with {run.learners} learners and {first.name} with "
                f"{first.learners}: each loss is the mean over a different number of "
                "learners, and gradients average over different batch totals"
            )
        if run.steps != first.steps:
            shared = len(set(run.steps) & set(first.steps))
            warn(
                f"{run.name} recorded {len(run.steps)} steps ({_span(run.steps)}) and "
                f"{first.name} {len(first.steps)} ({_span(first.steps)}): means over steps "
                f"cover different steps; the prediction uses the {shared} both recorded"
            )


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]}" if steps else "none"


def _views(summary: pd.DataFrame, dense: str | None, tolerance: float) -> list[View]:
    """The loss of each run, then where there are compressed runs their errors and
    bytes against the ``dense`` run's open-loop prediction."""
    views = [
        View(
            "loss of each run, mean over learners",
            summary,
            _LOSS_COLUMNS,
            "Per learner and per step: --json, --plot.",
        )
    ]
    compressed = summary[summary["label"] != "dense"]
    if len(compressed):
        shown = compressed.copy()
        for column in ("measured_bytes", "predicted_bytes", "divergence_step"):
            shown[column] = [_integer(v) for v in shown[column]]
        views.append(
            View(
                "compressed runs, means over steps",
                shown,
                _ERROR_COLUMNS,
                "Replayed on each run's recorded plan and memory: "
                + "; ".join(
                    f"{r.run} {r.granularity}, memory {r.memory}" for r in compressed.itertuples()
                )
                + ". "
                "Relative error ||ĝ-g||²/||g||² of the update applied online (online err), "
                "of the replay over the run's own gradients (own replay) and "
                + (
                    f"over the dense run's, {dense} (open-loop); payload bytes per learner "
                    "per step, online and predicted; first step where the open-loop error is "
                    f"off by more than {tolerance:g} (relative)."
                    if dense
                    else "payload bytes per learner per step. No dense run among the runs: "
                    "no open-loop prediction ('-'); add the dense run to get one."
                ),
            )
        )
    return views
