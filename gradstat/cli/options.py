"""Options shared by the analysis commands, so each means the same everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gradstat.analysis.compute import Compute, parse_bytes

CaptureArg = typer.Argument(
    ...,
    help="Capture folder written by `gradstat capture` (or its capture.h5).",
    show_default=False,
)
JsonOpt = typer.Option(False, "--json", help="Print one JSON document on stdout instead of tables.")
CsvOpt = typer.Option(None, "--csv", help="Also write the per-row results to this CSV file.")
PlotOpt = typer.Option(None, "--plot", help="Write a figure; format by suffix: .png, .pdf or .svg.")
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

Zeros = Annotated[
    str,
    typer.Option(
        "--zeros",
        help="Exact zeros in SIDCo and Gaussian-k fits: 'exclude' (fit the non-zeros at "
        "density k/nnz) or 'include' (every element at k/d, as the SIDCo authors' code).",
    ),
]
StageFit = Annotated[
    str,
    typer.Option(
        "--stage-fit",
        help="How SIDCo fits its GPD stages: 'moments' (as the SIDCo authors' code) or "
        "'mle' (maximum likelihood on a subsample; better on heavy tails).",
    ),
]

Device = Annotated[
    str,
    typer.Option(
        "--device",
        help="Where to compute: auto (a CUDA GPU when one is available), cpu or cuda.",
    ),
]
Memory = Annotated[
    str | None,
    typer.Option(
        "--memory",
        help="Memory for full-length rows, e.g. 2GB (default: a quarter of the available "
        "memory); a longer row is processed in column blocks.",
        show_default=False,
    ),
]

Jobs = Annotated[
    int | None,
    typer.Option(
        "--jobs",
        min=1,
        help="Worker processes (default: the CPUs this process may use; one for a small "
        "selection); see docs/large.md.",
        show_default=False,
    ),
]


def compute_options(
    device: str = "auto", memory: str | None = None, jobs: int | None = None
) -> Compute:
    """The ``Compute`` of the ``--device``, ``--memory`` and ``--jobs`` options, checked
    before any work starts (``--device cuda`` without a GPU is a usage error)."""
    bytes_ = None if memory is None else parse_bytes(memory)
    compute = Compute(device=device, jobs=jobs, memory=bytes_)
    compute.torch_device()
    return compute


__all__ = [
    "CaptureArg",
    "CsvOpt",
    "Device",
    "DpiOpt",
    "Jobs",
    "JsonOpt",
    "LearnersOpt",
    "Memory",
    "Path",
    "PlotOpt",
    "ScopeOpt",
    "StageFit",
    "StepsOpt",
    "Zeros",
    "compute_options",
]
