"""``gradstat report``: one self-contained HTML page with every analysis of a capture."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from gradstat import defaults
from gradstat.cli.options import (
    BANDWIDTH,
    LATENCY,
    RATIOS,
    REPORT_DPI,
    Bandwidth,
    Capture,
    ClusterSize,
    Compressors,
    Device,
    Dpi,
    ErrorBudget,
    Jobs,
    Latency,
    Memory,
    Ratios,
    compute_options,
)
from gradstat.cli.output import console, note_sample, progress
from gradstat.cli.paths import out_path
from gradstat.cli.replay import Target, TargetFile
from gradstat.compressors.cost import Link
from gradstat.compressors.targets import resolve_target
from gradstat.errors import UsageError
from gradstat.store import open_capture
from gradstat.threads import torch_threads

HtmlOut = Annotated[
    Path,
    typer.Option(
        "--out",
        "-o",
        metavar="FILE.html",
        callback=out_path,
        help="The HTML file to write.",
        show_default=False,
    ),
]


def report_command(
    capture: Capture,
    out: HtmlOut,
    ratios: Ratios = RATIOS,
    compressors: Compressors = defaults.REPORT_COMPRESSORS,
    error_budget: ErrorBudget = defaults.ERROR_BUDGET,
    bandwidth: Bandwidth = BANDWIDTH,
    latency: Latency = LATENCY,
    cluster_size: ClusterSize = None,
    target: Target = "cpu-here",
    target_file: TargetFile = None,
    dpi: Dpi = REPORT_DPI,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
    allow_damaged: Annotated[
        bool,
        typer.Option(
            "--allow-damaged",
            help="Write the report even where rows fail their checksums (the sections "
            "they stop say so, the page is marked damaged); by default that is an error.",
        ),
    ] = False,
) -> None:
    """Write one HTML page with every analysis, the verdict first.

    A self-contained page (figures embedded, no network needed): a summary box with the
    answers and the assumptions behind them, then the capture and its loss curve,
    distribution fits and estimator quality, similarity, build-up, temporal overlap,
    the replay comparison and the recommendation, each with a paragraph on what it
    shows.

    Compression is priced with one hardware profile for the whole page; pass the
    --out file of `gradstat recommend` as --target-file to quote that recommendation's
    numbers exactly.

    Example: gradstat report captures/lm -o report.html --cluster-size 64
    """
    if out.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"--out {out}: the report is HTML; use a .html file name")
    if not out.parent.exists():
        raise UsageError(f"--out {out}: folder {out.parent} does not exist")
    # matplotlib and seaborn load here, not on every gradstat command
    from gradstat.report.build import ReportSettings, build_report

    with torch_threads(defaults.THREADS):  # the threads the report's replay runs on
        profile = resolve_target(
            None if target_file and target == "cpu-here" else target, target_file
        )

    settings = ReportSettings(
        ratios,
        compressors,
        error_budget,
        Link(bandwidth, latency),
        cluster_size,
        dpi=dpi,
        compute=compute_options(device, memory, jobs),
        target=profile,
        target_file=str(target_file) if target_file else None,
    )
    with open_capture(capture, allow_damaged=allow_damaged) as cap:
        note_sample(cap)
        page = build_report(
            cap, settings, lambda key: lambda units: progress(units, key), allow_damaged
        )
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot write ({exc.strerror})") from None
    console.print(f"wrote the report to [bold]{escape(str(out))}[/bold] ({len(page) / 1e6:.1f} MB)")
