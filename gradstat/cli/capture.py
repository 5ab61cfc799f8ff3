"""``gradstat capture``: real data-parallel training that records local gradients."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from gradstat.capture.nodes import DEFAULT_JOIN_TIMEOUT
from gradstat.cli.options import COMPRESSOR_NAMES, list_compressors
from gradstat.cli.output import console, err_console, warn
from gradstat.store.ranks import format_ranks, parse_ranks

if TYPE_CHECKING:  # the launcher and the workloads import torch: loaded when run
    from gradstat.capture.budget import CapturePlan


def _list_workloads(value: bool) -> None:
    """Print the built-in workloads (parameters at their default size) and exit."""
    if not value:
        return
    from gradstat.capture.workloads import SIZE_NAMES, SPECS, parameter_count

    console.print(
        f"{'workload':<9}{'parameters':>11}  {'size':<6} {'data':<25}model", highlight=False
    )
    for spec in SPECS.values():
        count = parameter_count(spec.name)
        console.print(
            f"{spec.name:<9}{count:>11,}  {spec.default_size:<6} {spec.data:<25}{spec.description}",
            highlight=False,
            soft_wrap=True,
        )
    console.print(f"--size {'|'.join(SIZE_NAMES)} scales each model (docs/capture.md)")
    raise typer.Exit()


def capture_command(
    workload: str = typer.Option(
        "charlm",
        "--workload",
        "-w",
        help="Built-in workload: charlm, digits, resnet50, gpt2 or lstm (see --list-workloads).",
    ),
    list_workloads: bool = typer.Option(
        False,
        "--list-workloads",
        callback=_list_workloads,
        is_eager=True,
        help="List the workloads with their parameter counts and data, and exit.",
    ),
    steps: int = typer.Option(100, "--steps", help="Training steps to run."),
    every: int = typer.Option(1, "--every", help="Record every N-th step."),
    start: int = typer.Option(0, "--start", help="First step to record."),
    layers: str = typer.Option(
        None, "--layers", help="Regex of parameter names to record (default: all)."
    ),
    dtype: str = typer.Option(
        "float32",
        "--dtype",
        help="Storage type on disk: float32, bfloat16 or float16 (docs/format.md: when 2 "
        "bytes are safe).",
    ),
    record_ranks: str = typer.Option(
        "all",
        "--record-ranks",
        help="Learners that record: all, a list 0,3, a range 0-7 or every N-th ::8; the "
        "others run only the wrapped hook (no copy, no file).",
    ),
    compression: str = typer.Option(
        "none",
        "--compression",
        help="Lossless HDF5 compression: none, gzip, lzf, or lz4 / zstd (need hdf5plugin).",
    ),
    max_bytes: str = typer.Option(
        None,
        "--max-bytes",
        help="Refuse to start if the capture would exceed this size, e.g. 500MB, 20GiB, 1.5TB.",
    ),
    batch_size: int = typer.Option(32, "--batch-size", help="Per-learner batch size."),
    lr: float = typer.Option(
        None,
        "--lr",
        help="SGD learning rate, momentum 0.9 (default: 0.002 for resnet50, 0.01 for gpt2, "
        "0.05 for the others).",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of weights, shards and batches."),
    size: str = typer.Option(
        None,
        "--size",
        help="Model size: tiny, small, medium or large (default: large for resnet50, gpt2 "
        "and lstm, the papers' sizes; small for charlm and digits).",
    ),
    data: Path = typer.Option(
        None, "--data", help="Text file for the text workloads (charlm, gpt2, lstm)."
    ),
    out: Path = typer.Option(
        None, "--out", "-o", help="Capture folder (default: captures/<workload>-<timestamp>)."
    ),
    nproc_per_node: int = typer.Option(2, "--nproc-per-node", help="Learners on this machine."),
    nnodes: int = typer.Option(1, "--nnodes", help="Machines in the run (multi-node)."),
    node_rank: int = typer.Option(0, "--node-rank", help="This machine's rank (multi-node)."),
    master_addr: str = typer.Option(None, "--master-addr", help="Rendezvous host (multi-node)."),
    master_port: int = typer.Option(None, "--master-port", help="Rendezvous port (multi-node)."),
    join_timeout: float = typer.Option(
        DEFAULT_JOIN_TIMEOUT,
        "--join-timeout",
        help="Seconds to wait for the other nodes before giving up (multi-node).",
    ),
    backend: str = typer.Option(
        "auto", "--backend", help="auto (nccl with enough GPUs, else gloo), gloo or nccl."
    ),
    comm_hook: str = typer.Option(
        "allreduce", "--comm-hook", help="The DDP hook gradstat wraps: allreduce, fp16 or powersgd."
    ),
    compressor: str = typer.Option(
        None,
        "--compressor",
        callback=list_compressors,
        is_eager=True,
        help="Train with this compressor as the DDP hook and record what each learner sent "
        f"too (docs/online.md): {COMPRESSOR_NAMES}",
    ),
    ratio: float = typer.Option(None, "--ratio", help="Density k/d of a --compressor sparsifier."),
    fsdp: bool = typer.Option(
        False,
        "--fsdp",
        help="Train with FSDP2 (fully_shard per transformer block / ResNet bottleneck, then "
        "the root) instead of DDP; records each learner's gradient before the "
        "reduce-scatter (docs/capture.md, FSDP).",
    ),
) -> None:
    """Train with DistributedDataParallel (or FSDP2) and record each learner's local
    gradient.

    Launches one process per learner with torch.distributed.run (torchrun), records
    each learner's gradient before the all-reduce with a DDP communication hook (with
    --fsdp: before each unit's reduce-scatter), and writes one HDF5 file per learner
    plus capture.h5 (see docs/format.md).

    Example: gradstat capture --workload digits --nproc-per-node 4 --steps 100 --every 5
    """
    from gradstat.capture.budget import recorded_rows
    from gradstat.capture.launch import CaptureOptions, recorded, run_capture
    from gradstat.sizes import format_bytes, parse_bytes

    options = CaptureOptions(
        workload=workload,
        steps=steps,
        out=out,
        every=every,
        start=start,
        layers=layers,
        dtype=dtype,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        size=size,
        data=data,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        backend=backend,
        comm_hook=comm_hook,
        join_timeout=join_timeout,
        compressor=compressor,
        ratio=ratio,
        record_ranks=record_ranks,
        compression=compression,
        max_bytes=None if max_bytes is None else parse_bytes(max_bytes, "--max-bytes"),
        fsdp=fsdp,
    )
    options.check()
    run_dir = options.run_dir()
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
        task = bar.add_task("capture", total=steps, loss="-", mb=0.0, rate=0.0)

        plan_of_run: list[CapturePlan] = []

        def on_plan(plan: CapturePlan, free: int) -> None:
            plan_of_run.append(plan)
            err_console.print(
                f"capture: expected {plan.describe()}; {format_bytes(free)} free", highlight=False
            )

        def on_progress(report: dict) -> None:
            rows = recorded_rows(report["step"], options.every, options.start)
            bar.update(
                task,
                completed=report["step"],
                loss=f"{report['loss']:.3f}",
                mb=rows * plan_of_run[0].row_bytes * plan_of_run[0].learners / 1e6,
                rate=report["step"] / max(report["elapsed"], 1e-9),
            )

        def on_wait(line: str) -> None:
            err_console.print(escape(line), highlight=False)

        run_capture(
            options, on_progress=on_progress, on_warning=warn, on_wait=on_wait, on_plan=on_plan
        )
    state = recorded(run_dir)
    where = escape(str(run_dir))
    if state is None:  # a node > 0 whose folder is not shared with node 0
        first = node_rank * nproc_per_node
        console.print(
            f"node {node_rank} recorded learners {first}..{first + nproc_per_node - 1} to "
            f"[bold]{where}[/bold]; join it to node 0's folder with gradstat merge"
        )
        return
    steps_done = state[0]
    ranks = parse_ranks(options.record_ranks, options.world_size)
    learners = (
        f"{len(ranks)} learners"
        if len(ranks) == options.world_size
        else f"{len(ranks)} of {options.world_size} learners (ranks {format_ranks(ranks)})"
    )
    console.print(f"captured {steps_done} steps x {learners} to [bold]{where}[/bold]")
    console.print(f"next: gradstat info {where}")
