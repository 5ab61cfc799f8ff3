"""Options shared by the analysis commands, so each means the same everywhere."""

from __future__ import annotations

from pathlib import Path

import typer

from gradstat.cli.paths import csv_path, plot_path

CaptureArg = typer.Argument(
    ...,
    help="Capture folder written by `gradstat capture` (or its capture.h5).",
    show_default=False,
)
JsonOpt = typer.Option(False, "--json", help="Print one JSON document on stdout instead of tables.")
CsvOpt = typer.Option(
    None, "--csv", help="Also write the per-row results to this CSV file.", callback=csv_path
)
PlotOpt = typer.Option(
    None,
    "--plot",
    help="Write a figure; format by suffix: .png, .pdf or .svg.",
    callback=plot_path,
)
DpiOpt = typer.Option(150, "--dpi", min=30, max=1200, help="Resolution of raster figures.")
StepsOpt = typer.Option(
    None,
    "--steps",
    help="Recorded training steps: N, A,B,C or START:STOP[:EVERY] (default: all).",
)
LearnersOpt = typer.Option(
    None, "--learners", help="Comma-separated ranks, e.g. 0,2 (default: all)."
)
ScopeOpt = typer.Option(
    "model",
    "--scope",
    help="'model' (whole flat vector), 'layers' (each parameter) or a regex of layer names.",
)

__all__ = [
    "CaptureArg",
    "CsvOpt",
    "DpiOpt",
    "JsonOpt",
    "LearnersOpt",
    "Path",
    "PlotOpt",
    "ScopeOpt",
    "StepsOpt",
]
