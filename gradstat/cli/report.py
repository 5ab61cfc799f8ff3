"""``gradstat report``: one self-contained HTML page with every analysis of a capture."""

from __future__ import annotations

from pathlib import Path

import typer

from gradstat.analysis.selection import parse_ratios
from gradstat.cli.options import CaptureArg, Device, Jobs, Memory, compute_options
from gradstat.cli.output import console, note_sample, progress
from gradstat.compressors.cost import Link, parse_bandwidth, parse_latency
from gradstat.errors import UsageError
from gradstat.report.build import ReportSettings, build_report
from gradstat.store import open_capture


def report_command(
    capture: Path = CaptureArg,
    out: Path = typer.Option(
        ..., "--out", "-o", help="The HTML file to write.", show_default=False
    ),
    ratios: str = typer.Option(
        "0.01,0.001", "--ratios", help="Densities k/d for fits, build-up and replay."
    ),
    compressors: str = typer.Option(
        ReportSettings.compressors,
        "--compressors",
        help="Compressors of the replay section.",
    ),
    error_budget: float = typer.Option(
        0.5, "--error-budget", help="Mean relative error the recommendation may spend."
    ),
    bandwidth: str = typer.Option(
        "10Gbit/s", "--bandwidth", help="Link bandwidth of the cost model."
    ),
    latency: str = typer.Option("5us", "--latency", help="Per-message latency of the cost model."),
    learners: int = typer.Option(
        None, "--learners", help="Cluster size for the cost model (default: the run's world size)."
    ),
    dpi: int = typer.Option(
        110, "--dpi", min=30, max=600, help="Resolution of the embedded figures."
    ),
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """Write one self-contained HTML page (figures embedded, no network needed) with the
    capture's summary and loss curve, distribution fits and estimator quality,
    similarity, build-up, temporal overlap, the replay comparison and the
    recommendation, each with a paragraph on what it shows.

    Example: gradstat report captures/lm -o report.html --learners 64
    """
    if out.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"--out {out}: the report is HTML; use a .html file name")
    if not out.parent.exists():
        raise UsageError(f"--out {out}: folder {out.parent} does not exist")
    settings = ReportSettings(
        ratios=parse_ratios(ratios),
        compressors=compressors,
        error_budget=error_budget,
        link=Link(parse_bandwidth(bandwidth), parse_latency(latency)),
        cost_learners=learners,
        dpi=dpi,
        compute=compute_options(device, memory, jobs),
    )
    with open_capture(capture) as cap:
        note_sample(cap)
        page = build_report(cap, settings, lambda section: lambda items: progress(items, section))
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot write ({exc.strerror})") from None
    console.print(f"wrote the report to [bold]{out}[/bold] ({len(page) / 1e6:.1f} MB)")
