"""``gradstat compare``: dense and compressed runs of one workload side by side, and the
replay's prediction against what the compression hook measured online."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gradstat.cli.options import DPI, Csv, Dpi, Json, Plot
from gradstat.cli.output import Output, Result, View, show
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
    compressor (docs/compressors.md) imports it again from the spec it recorded.

    Example: gradstat compare captures/lm captures/lm-topk --plot compare.png
    """
    from gradstat.analysis.compare import compare

    result = compare([str(r) for r in runs], tolerance)

    def figure():
        from gradstat.plots.compare import plot_compare

        return plot_compare(result.losses, result.errors)

    views = _views(result.summary, result.dense, tolerance)
    shown_result = Result(result.errors, summary=views, document=result.to_dict(), figure=figure)
    show(shown_result, Output(as_json, csv, False, plot, dpi))


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
                + ". Relative error ||ĝ-g||²/||g||² of the update applied online (online err), "
                "of the replay over the run's own gradients (own replay) and over the dense "
                f"run's, {dense or 'none'} (open-loop); payload bytes per learner per step, "
                "online and predicted; first step where the open-loop error is off by more "
                f"than {tolerance:g} (relative).",
            )
        )
    return views
