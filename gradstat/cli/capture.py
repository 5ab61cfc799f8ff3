"""``gradstat capture``: real data-parallel training that records local gradients."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gradstat.capture.nodes import DEFAULT_JOIN_TIMEOUT
from gradstat.cli.capture_options import (
    Backend,
    BatchSize,
    CaptureOut,
    CommHook,
    Compression,
    Compressor,
    Data,
    Dtype,
    Every,
    Fsdp,
    Hsdp,
    JoinTimeout,
    Layers,
    ListWorkloads,
    Lr,
    MasterAddr,
    MasterPort,
    MaxBytes,
    Nnodes,
    NodeRank,
    NprocPerNode,
    Ratio,
    RecordRanks,
    Resume,
    Save,
    Size,
    Start,
    TrainingSeed,
    TrainingSteps,
    WarmupSteps,
    Workload,
)
from gradstat.cli.output import console, err_console, warn
from gradstat.store.ranks import format_ranks, parse_ranks

if TYPE_CHECKING:  # the launcher and the workloads import torch: loaded when run
    from gradstat.capture.budget import CapturePlan
    from gradstat.capture.launch import CaptureOptions


def capture_command(
    workload: Workload = "charlm",
    list_workloads: ListWorkloads = False,
    steps: TrainingSteps = 100,
    warmup_steps: WarmupSteps = 0,
    every: Every = 1,
    start: Start = 0,
    layers: Layers = None,
    dtype: Dtype = "float32",
    record_ranks: RecordRanks = "all",
    compression: Compression = "none",
    max_bytes: MaxBytes = None,
    batch_size: BatchSize = 32,
    lr: Lr = None,
    seed: TrainingSeed = 0,
    size: Size = None,
    data: Data = None,
    out: CaptureOut = None,
    nproc_per_node: NprocPerNode = 2,
    nnodes: Nnodes = 1,
    node_rank: NodeRank = 0,
    master_addr: MasterAddr = None,
    master_port: MasterPort = None,
    join_timeout: JoinTimeout = DEFAULT_JOIN_TIMEOUT,
    backend: Backend = "auto",
    comm_hook: CommHook = "allreduce",
    compressor: Compressor = None,
    ratio: Ratio = None,
    fsdp: Fsdp = False,
    hsdp: Hsdp = 1,
    save: Save = None,
    resume: Resume = None,
) -> None:
    """Train with DistributedDataParallel (or FSDP2) and record each learner's local
    gradient.

    Launches one process per learner with torch.distributed.run (torchrun), records
    each learner's gradient before the all-reduce with a DDP communication hook (with
    --fsdp: before each unit's reduce-scatter), and writes one HDF5 file per learner
    plus capture.h5 (see docs/format.md).

    Example: gradstat capture --workload digits --nproc-per-node 4 --steps 100 --every 5

    Trained states: --warmup-steps 3000 trains first and records after; --save FILE
    and --resume FILE continue a run across captures (docs/capture.md).
    """
    options = _capture_options(locals())  # first: locals() holds only the options
    options.check()
    run_dir = _run(options)
    _say_where(options, run_dir)


def _capture_options(values: dict) -> CaptureOptions:
    """The command's ``values`` (named as the fields of ``CaptureOptions``) as its
    ``CaptureOptions``, with ``--max-bytes`` parsed (``MB`` = 10^6, ``MiB`` = 2^20)."""
    from gradstat.capture.launch import CaptureOptions
    from gradstat.sizes import parse_bytes

    values = {k: v for k, v in values.items() if k != "list_workloads"}
    limit = values.pop("max_bytes")
    max_bytes = None if limit is None else parse_bytes(limit, "--max-bytes")
    return CaptureOptions(**values, max_bytes=max_bytes)


def _run(options: CaptureOptions) -> Path:
    """Run the capture with a progress bar (loss, megabytes recorded, steps per
    second) on a terminal, the expected size first and each node's wait lines; the
    run folder."""
    from gradstat.capture.budget import recorded_rows
    from gradstat.capture.launch import run_capture
    from gradstat.sizes import format_bytes

    columns = (
        TextColumn("[bold]capture"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[mb]:.1f} MB recorded"),
        TextColumn("{task.fields[rate]:.1f} steps/s"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err_console, disable=not err_console.is_terminal) as bar:
        total = options.warmup_steps + options.steps
        task = bar.add_task("capture", total=total, loss="-", mb=0.0, rate=0.0)
        plan_of_run: list[CapturePlan] = []

        def on_plan(plan: CapturePlan, free: int) -> None:
            plan_of_run.append(plan)
            err_console.print(
                f"capture: expected {plan.describe()}; {format_bytes(free)} free", highlight=False
            )

        def on_progress(report: dict) -> None:
            trained = max(0, report["step"] - options.warmup_steps)  # recorded phase
            rows = recorded_rows(trained, options.every, options.start)
            bar.update(
                task,
                completed=report["step"],
                loss=f"{report['loss']:.3f}",
                mb=rows * plan_of_run[0].row_bytes * plan_of_run[0].learners / 1e6,
                rate=report["step"] / max(report["elapsed"], 1e-9),
            )

        def on_wait(line: str) -> None:
            err_console.print(escape(line), highlight=False)

        return run_capture(
            options, on_progress=on_progress, on_warning=warn, on_wait=on_wait, on_plan=on_plan
        )


def _say_where(options: CaptureOptions, run_dir: Path) -> None:
    """What was captured where, and the next command to run."""
    from gradstat.capture.launch import recorded

    state = recorded(run_dir)
    where = escape(str(run_dir))
    if state is None:  # a node > 0 whose folder is not shared with node 0
        count = options.nproc_per_node
        first = options.node_rank * count
        console.print(
            f"node {options.node_rank} recorded learners {first}..{first + count - 1} to "
            f"[bold]{where}[/bold]; join it to node 0's folder with gradstat merge"
        )
        return
    ranks = parse_ranks(options.record_ranks, options.world_size)
    learners = (
        f"{len(ranks)} learner" + ("s" if len(ranks) != 1 else "")
        if len(ranks) == options.world_size
        else f"{len(ranks)} of {options.world_size} learners (ranks {format_ranks(ranks)})"
    )
    steps = f"{state[0]} step" + ("s" if state[0] != 1 else "")
    console.print(f"captured {steps} x {learners} to [bold]{where}[/bold]")
    console.print(f"next: gradstat info {where}")
