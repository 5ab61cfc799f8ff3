"""Every option of the analysis commands, declared once (``typer.Annotated`` aliases).

An option means the same in every command, parses in one place (``--ratios`` arrives as
a tuple of floats, ``--bandwidth`` as bytes per second, ``--plot`` is checked before
any work) and takes its default from the constants below, which the report shares.
"""

from __future__ import annotations

import os
import warnings
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gradstat import defaults
from gradstat.cli.paths import csv_path, plot_path
from gradstat.compressors.cost import parse_bandwidth, parse_latency
from gradstat.compressors.names import BUILTIN
from gradstat.defaults import ratios_text
from gradstat.errors import GradstatWarning, UsageError

if TYPE_CHECKING:  # the analyses import torch: --help and --version never load them
    from gradstat.analysis.compute import Compute

# Defaults come from gradstat.defaults (the report shares them); as option text here.
RATIOS = ratios_text(defaults.RATIOS)
SET_RATIOS = ratios_text(defaults.SET_RATIOS)
BANDWIDTH, LATENCY = defaults.BANDWIDTH, defaults.LATENCY
DPI, REPORT_DPI = defaults.DPI, defaults.REPORT_DPI
RANK, BETA, SEED, THREADS = defaults.RANK, defaults.BETA, defaults.SEED, defaults.THREADS


class RatioList(tuple):
    """Densities k/d, each in (0, 1): what ``--ratios`` parses to (a tuple of floats)."""


def _ratios(text: str | RatioList) -> RatioList:
    from gradstat.analysis.selection import parse_ratios

    if isinstance(text, RatioList):
        return text
    try:
        return RatioList(parse_ratios(str(text)))
    except UsageError:
        raise UsageError(
            f"--ratios {text}: each ratio is a density k/d strictly between 0 and 1, "
            "e.g. 0.01 or 0.01,0.001"
        ) from None


def between(low: int, high: int | None = None):
    """A callback refusing integers outside [low, high] (the range in the help text, not
    in the metavar column, so help stays readable at 80 columns)."""

    def check(value: int | None) -> int | None:
        if value is None:
            return None
        if value < low or (high is not None and value > high):
            upper = f" and {high}" if high is not None else " or more"
            raise typer.BadParameter(f"{value}: use {'between ' if high else ''}{low}{upper}")
        return value

    return check


class Baseline(str, Enum):
    """The dense all-reduce a compressor must beat."""

    fp32 = "fp32"
    fp16 = "fp16"


class On(str, Enum):
    """Which vectors the top-k sets are taken of."""

    raw = "raw"
    ef = "ef"


def _capture_path(text: str | Path) -> Path:
    """The CAPTURE argument: a path, never the empty text (which Path reads as ".")."""
    if isinstance(text, Path):
        return text
    if not text.strip():
        raise UsageError("CAPTURE is empty; give a capture folder")
    return Path(text)


def _not_empty(option: str):
    def check(value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise UsageError(f"{option} is empty; leave it out to select all")
        return value

    return check


# Input and selection
Capture = Annotated[
    Path,
    typer.Argument(
        metavar="CAPTURE",
        parser=_capture_path,
        help="Capture folder written by `gradstat capture` (or its capture.h5).",
        show_default=False,
    ),
]
Steps = Annotated[
    str | None,
    typer.Option(
        "--steps",
        metavar="SPEC",
        callback=_not_empty("--steps"),
        help="Recorded training steps: N, A,B,C or START:STOP[:EVERY] (default: all).",
        show_default=False,
    ),
]
Learners = Annotated[
    str | None,
    typer.Option(
        "--learners",
        metavar="RANKS",
        callback=_not_empty("--learners"),
        help="Comma-separated ranks, e.g. 0,2 (default: all).",
        show_default=False,
    ),
]
Scope = Annotated[
    str,
    typer.Option(
        "--scope",
        metavar="SCOPE",
        help="'model' (whole flat vector), 'layers' (each parameter) or a regex of layer names.",
    ),
]
Granularity = Annotated[
    str | None,
    typer.Option(
        "--granularity",
        metavar="G",
        show_default="the capture's: bucket for DDP, unit for FSDP2, else model",
        help="How a step is cut into messages: model (the flat vector), tensor (each "
        "parameter in its shape), bucket[:MB] (DDP's buckets, bucket_cap_mb MB) or unit "
        "(FSDP2's fully_shard units, inside the reduce-scatter).",
    ),
]
Dense = Annotated[
    str | None,
    typer.Option(
        "--dense",
        metavar="REGEX",
        help="Parameters whose name matches are sent uncompressed (e.g. 'bias|norm').",
    ),
]
DenseBelow = Annotated[
    int,
    typer.Option(
        "--dense-below",
        metavar="N",
        callback=between(0),
        help="Parameters of fewer than N values are sent uncompressed.",
    ),
]
Ratios = Annotated[
    RatioList,
    typer.Option(
        "--ratios",
        metavar="R[,R...]",
        parser=_ratios,
        help="Target densities k/d, comma-separated, each in (0, 1); one value is fine.",
    ),
]
OnVectors = Annotated[
    On,
    typer.Option(
        "--on",
        help="raw: the recorded gradients; ef: g + memory of a top-k error-feedback replay "
        "over consecutive recorded steps (what the compressor sees).",
    ),
]
Seed = Annotated[int, typer.Option("--seed", help="Seed of every sampling step.")]
LearnerBatch = Annotated[
    int | None,
    typer.Option(
        "--batch-size",
        metavar="B",
        callback=between(1),
        help="Each learner's batch size b (default: the one the capture recorded).",
        show_default=False,
    ),
]

# How SIDCo fits (fit)
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

# Where and with how much to compute
Device = Annotated[
    str,
    typer.Option(
        "--device",
        metavar="DEVICE",
        help="Where to compute: auto (a CUDA GPU when one is available), cpu or cuda.",
    ),
]
Memory = Annotated[
    str | None,
    typer.Option(
        "--memory",
        metavar="SIZE",
        help="Memory for full-length rows, e.g. 2GB or 1.5GiB (default: a quarter of the available "
        "memory); a longer row, or one over 16M values, is processed in column blocks.",
        show_default=False,
    ),
]


Jobs = Annotated[
    int | None,
    typer.Option(
        "--jobs",
        metavar="N",
        callback=between(1),
        help="Worker processes, 1 or more (default: 1, which measured fastest on the "
        "machines gradstat was tuned on); see docs/large.md.",
        show_default=False,
    ),
]


def compute_options(
    device: str = "auto", memory: str | None = None, jobs: int | None = None
) -> Compute:
    """The ``Compute`` of the ``--device``, ``--memory`` and ``--jobs`` options, checked
    before any work starts (``--device cuda`` without a GPU is a usage error)."""
    from gradstat.analysis.compute import Compute
    from gradstat.sizes import parse_bytes

    bytes_ = None if memory is None else parse_bytes(memory, "--memory")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if jobs is not None and cpus and jobs > cpus:
        warnings.warn(
            f"--jobs {jobs}: this process may use {cpus} CPUs; running {cpus} workers",
            GradstatWarning,
            stacklevel=2,
        )
        jobs = cpus
    compute = Compute(device=device, jobs=jobs, memory=bytes_)
    try:
        compute.torch_device()
    except UsageError:
        import torch

        why = (
            f"this torch ({torch.__version__}) is built without CUDA"
            if torch.version.cuda is None
            else "torch sees no CUDA device (check the driver and CUDA_VISIBLE_DEVICES)"
        )
        raise UsageError(f"--device {device}: no CUDA GPU here, {why}; use --device cpu") from None
    return compute


# Cost model and compressors
Bandwidth = Annotated[
    float,
    typer.Option(
        "--bandwidth",
        metavar="RATE",
        parser=parse_bandwidth,
        help="Link bandwidth, e.g. 10Gbit/s, 25Gbps or 1.25GB/s.",
    ),
]
Latency = Annotated[
    float,
    typer.Option(
        "--latency", metavar="TIME", parser=parse_latency, help="Per-message latency, e.g. 5us."
    ),
]
ClusterSize = Annotated[
    int | None,
    typer.Option(
        "--cluster-size",
        metavar="N",
        callback=between(2),
        help="Learners the cost model assumes (default: the run's world size). Errors are "
        "always measured with the capture's recorded learners.",
        show_default=False,
    ),
]


def list_compressors(value: str | None) -> str | None:
    """``--compressors list``: print the registry's and installed packages' compressors
    and exit (an eager callback: it runs before the capture argument is checked)."""
    if value != "list":
        return value
    from rich.table import Table

    from gradstat.cli.output import console
    from gradstat.compressors.registry import REGISTRY
    from gradstat.compressors.spec import GROUP, entry_points

    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("compressor", "rate", "what"):
        table.add_column(column)
    for name, entry in REGISTRY.items():
        table.add_row(name, "fixed" if entry.fixed_rate else "ratios", entry.summary)
    for name, ep in sorted(entry_points().items()):
        table.add_row(name, "", f"{ep.value} (an installed package's, {GROUP})")
    console.print(table)
    console.print(
        "Your own: MODULE:CLASS or path/to/file.py:CLASS, each with optional :PARAM=VALUE "
        "(docs/compressors.md).",
        highlight=False,
    )
    raise typer.Exit()


#: What the help of every option naming compressors says about the names.
COMPRESSOR_NAMES = (
    f"NAME[:PARAM=VALUE][+MEMORY] with NAME one of {', '.join(BUILTIN)} (docs/replay.md), "
    "or your own as MODULE:CLASS or FILE.py:CLASS (docs/compressors.md); MEMORY: none, "
    "residual, dgc or your own (e.g. terngrad+residual); :collective=allgather|allreduce "
    "on any; on a number format :algorithm=ring|tree|a2a and :accumulate=fp32|wire "
    "(e.g. fp8-e4m3:algorithm=a2a, docs/lowprecision.md); 'list' describes them."
)
Compressors = Annotated[
    str,
    typer.Option(
        "--compressors",
        metavar="LIST",
        callback=list_compressors,
        is_eager=True,
        help=f"Comma-separated compressors: {COMPRESSOR_NAMES}",
    ),
]
MaybeCompressors = Annotated[
    str | None,
    typer.Option(
        "--compressors",
        metavar="LIST",
        callback=list_compressors,
        is_eager=True,
        help="Also measure these compressors' error on each learner's gradient, "
        f"comma-separated (default: none): {COMPRESSOR_NAMES}",
        show_default=False,
    ),
]
ErrorBudget = Annotated[
    float,
    typer.Option(
        "--error-budget",
        metavar="E",
        help="Largest acceptable mean relative error ||ĝ-g||²/||g||², e.g. 0.2.",
    ),
]
BaselineOpt = Annotated[
    Baseline, typer.Option("--baseline", help="Dense all-reduce to beat: fp32 or fp16.")
]
Rank = Annotated[
    int,
    typer.Option(
        "--rank", callback=between(1), help="PowerSGD rank r (powersgd:rank=R overrides)."
    ),
]
Beta = Annotated[
    float,
    typer.Option("--beta", help="CLT-k low-pass memory factor in (0, 1] (clt-k:beta=B overrides)."),
]
Threads = Annotated[
    int,
    typer.Option(
        "--threads",
        callback=between(1),
        help="Torch CPU threads while replaying; compress times are per learner on this many.",
    ),
]

# Output
Json = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")
]
Csv = Annotated[
    Path | None,
    typer.Option(
        "--csv",
        metavar="PATH",
        callback=csv_path,
        help="Also write the per-row results to this CSV file.",
    ),
]
Detail = Annotated[
    bool,
    typer.Option("--detail", help="Also print the per-row tables (every step and learner)."),
]
Plot = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        metavar="PATH",
        callback=plot_path,
        help="Write a figure; format by suffix: .png, .pdf or .svg.",
    ),
]
Dpi = Annotated[
    int,
    typer.Option("--dpi", callback=between(30, 1200), help="Resolution of figures, 30 to 1200."),
]

# Runs trained with a compressor (compare, report)
TrainedWith = Annotated[
    list[str] | None,
    typer.Option(
        "--trained-with",
        metavar="RUN=SPEC",
        help="The compressor a run trained with your own class, as you name it for "
        "replay (MODULE:CLASS or FILE.py:CLASS, docs/compressors.md); repeatable. "
        "gradstat never imports code a capture names; a built-in recorded in the "
        "capture needs no --trained-with.",
        show_default=False,
    ),
]
