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
    Dense,
    DenseBelow,
    Device,
    Dpi,
    ErrorBudget,
    Granularity,
    Jobs,
    Latency,
    Memory,
    Ratios,
    TrainedWith,
    compute_options,
)
from gradstat.cli.output import console, note_sample, progress
from gradstat.cli.paths import out_path
from gradstat.cli.replay import Target, TargetFile, plan_options, target_profile
from gradstat.compressors.cost import Link
from gradstat.errors import UsageError
from gradstat.store import open_capture


def _html_path(path: Path | None) -> Path | None:
    """Callback of the report's ``--out``: an ``.html`` file in a writable place."""
    path = out_path(path)
    if path is not None and path.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"--out {path}: the report is HTML; use a .html file name")
    return path


HtmlOut = Annotated[
    Path,
    typer.Option(
        "--out",
        "-o",
        metavar="FILE.html",
        callback=_html_path,
        help="The HTML file to write.",
        show_default=False,
    ),
]
WithRuns = Annotated[
    list[Path] | None,
    typer.Option(
        "--with",
        metavar="RUN",
        help="Another capture of the same training (dense, or trained with --compressor) "
        "to compare with in the section 'Dense and compressed training'; repeatable. "
        "Only the captures named are read.",
        show_default=False,
    ),
]
AllowDamaged = Annotated[
    bool,
    typer.Option(
        "--allow-damaged",
        help="Write the report even where rows fail their checksums (the sections "
        "they stop say so, the page is marked damaged); by default that is an error.",
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
    granularity: Granularity = None,
    dense: Dense = None,
    dense_below: DenseBelow = 0,
    dpi: Dpi = REPORT_DPI,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
    with_runs: WithRuns = None,
    trained_with: TrainedWith = None,
    allow_damaged: AllowDamaged = False,
) -> None:
    """Write one HTML page with every analysis, the verdict first.

    A self-contained page (figures embedded, no network needed): a summary box with the
    answers and the assumptions behind them, then the capture and its loss curve,
    distribution fits and estimator quality, similarity, build-up, temporal overlap,
    the replay comparison and the recommendation, each with a paragraph on what it
    shows.

    Compression is priced with one hardware profile for the whole page; pass the
    --out file of `gradstat recommend` as --target-file to quote that recommendation's
    numbers exactly; --with RUN adds the comparison with those runs (gradstat compare).

    Example: gradstat report captures/lm -o report.html --cluster-size 64
    """
    from gradstat.report.build import build_report  # matplotlib loads here, with the command
    from gradstat.report.context import ReportSettings

    settings = ReportSettings(
        ratios,
        compressors,
        error_budget,
        Link(bandwidth, latency),
        cluster_size,
        dpi=dpi,
        target=target_profile(target, target_file, defaults.THREADS),  # the replay's threads
        compute=compute_options(device, memory, jobs),
        **_other_files(capture, target_file, with_runs, trained_with),
        **plan_options(granularity, dense, dense_below),
    )
    with open_capture(capture, allow_damaged=allow_damaged) as cap:
        note_sample(cap)
        _write_page(build_report(cap, settings, _section_progress, allow_damaged), out)


def _other_files(
    capture: Path, target_file: Path | None, runs: list[Path] | None, trained_with: list[str] | None
) -> dict:
    """The settings of what the report reads besides the capture: ``--target-file``'s
    name, and the ``--with`` runs and ``--trained-with``, checked before minutes of work
    (each run opens; each trained with a user's class has one named)."""
    from gradstat.analysis.trained_with import check_runs, parse_trained_with

    paths = [str(run) for run in runs or ()]
    given = parse_trained_with(trained_with)
    if paths or given:
        check_runs([str(capture), *paths], given)
    target = str(target_file) if target_file else None
    return {"target_file": target, "with_runs": paths, "trained_with": given}


def _section_progress(key: str):
    """The progress wrapper of the work units of the report's section ``key``."""
    return lambda units: progress(units, key)


def _write_page(page: str, out: Path) -> None:
    """The page to ``out``, whole or not at all (gradstat/atomic.py)."""
    from gradstat.atomic import replacing

    with replacing(out, "--out") as handle:
        handle.write(page.encode("utf-8"))
    console.print(f"wrote the report to [bold]{escape(str(out))}[/bold] ({len(page) / 1e6:.1f} MB)")
