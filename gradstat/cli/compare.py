"""``gradstat compare``: dense and compressed runs of one workload side by side, and the
replay's prediction against what the compression hook measured online."""

from __future__ import annotations

import math
from pathlib import Path

import typer

from gradstat.analysis.compare import DIVERGENCE_TOLERANCE, compare
from gradstat.cli.options import CsvOpt, DpiOpt, JsonOpt, PlotOpt
from gradstat.cli.output import df_table, emit
from gradstat.plots.paths import check_plot_path

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
    runs: list[Path] = typer.Argument(
        ..., help="Capture folders of the same workload and seed: dense and --compressor runs."
    ),
    tolerance: float = typer.Option(
        DIVERGENCE_TOLERANCE,
        "--tolerance",
        help="Relative gap between predicted and measured error that counts as divergence.",
    ),
    as_json: bool = JsonOpt,
    csv: Path | None = CsvOpt,
    plot: Path | None = PlotOpt,
    dpi: int = DpiOpt,
) -> None:
    """Loss curves of dense and compressed runs side by side; for each compressed run the
    relative error and bytes per step measured online (from its grad and sent rows), the
    replay over its own gradients, and the replay's open-loop prediction over the dense
    run's gradients, with the step where prediction and measurement part."""
    check_plot_path(plot)
    result = compare([str(r) for r in runs], tolerance)
    summary = result.summary
    tables = [
        df_table(
            summary[list(_LOSS_COLUMNS)].rename(columns=_LOSS_COLUMNS),
            "loss of each run, mean over learners (per learner and per step: --json, --plot)",
        )
    ]
    compressed = summary[summary["label"] != "dense"]
    if len(compressed):
        dense = result.dense or "none"
        shown = compressed[list(_ERROR_COLUMNS)].rename(columns=_ERROR_COLUMNS)
        for column in ("bytes", "predicted"):
            shown[column] = [_integer(v) for v in shown[column]]
        shown["diverges"] = [_integer(v) for v in shown["diverges"]]
        tables.append(
            df_table(
                shown,
                "compressed runs, means over steps: relative error ||ĝ-g||²/||g||² of the "
                "update applied online (online err), of the replay over the run's own "
                f"gradients (own replay) and over the dense run's, {dense} (open-loop); "
                "payload bytes per learner per step, online and predicted; first step "
                f"where the open-loop error is off by more than {tolerance:g} (relative)",
            )
        )
    emit(
        result.errors,
        as_json=as_json,
        csv=csv,
        tables=tables,
        json_document=result.to_dict(),
    )
    if plot is not None:
        from gradstat.plots.compare import plot_compare
        from gradstat.plots.style import save_figure

        save_figure(plot_compare(result.losses, result.errors), plot, dpi=dpi)
