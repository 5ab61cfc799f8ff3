"""The options of ``gradstat capture`` (``typer.Annotated`` aliases, as in
gradstat/cli/options.py): how the built-in training runs and what it records.

``--steps`` and ``--seed`` here are the training's (steps to run, the seed of weights,
shards and batches), not the analyses' selection of recorded steps and sampling seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gradstat.cli.options import COMPRESSOR_NAMES, list_compressors
from gradstat.cli.output import console


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


Workload = Annotated[
    str,
    typer.Option(
        "--workload",
        "-w",
        help="Built-in workload: charlm, digits, resnet50, gpt2 or lstm (see --list-workloads).",
    ),
]
ListWorkloads = Annotated[
    bool,
    typer.Option(
        "--list-workloads",
        callback=_list_workloads,
        is_eager=True,
        help="List the workloads with their parameter counts and data, and exit.",
    ),
]
TrainingSteps = Annotated[
    int,
    typer.Option("--steps", help="Training steps to run and record from (after --warmup-steps)."),
]
Every = Annotated[int, typer.Option("--every", help="Record every N-th step.")]
WarmupSteps = Annotated[
    int,
    typer.Option(
        "--warmup-steps",
        metavar="N",
        help="Train N steps unrecorded first, then the --steps recorded ones (statistics of "
        "a trained model, not of its initialisation).",
    ),
]
Save = Annotated[
    Path | None,
    typer.Option(
        "--save",
        metavar="CHECKPOINT",
        help="At the end, save model, optimizer, data position and RNG to this file "
        "(DDP runs; docs/capture.md).",
    ),
]
Resume = Annotated[
    Path | None,
    typer.Option(
        "--resume",
        metavar="CHECKPOINT",
        help="Continue the run a --save file stopped at: training steps go on from its "
        "step (same workload, size, data, seed, batch size and learners).",
    ),
]
Start = Annotated[int, typer.Option("--start", help="First step to record.")]
Layers = Annotated[
    str | None, typer.Option("--layers", help="Regex of parameter names to record (default: all).")
]
Dtype = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="Storage type on disk: float32, bfloat16 or float16 (docs/format.md: when 2 "
        "bytes are safe).",
    ),
]
RecordRanks = Annotated[
    str,
    typer.Option(
        "--record-ranks",
        help="Learners that record: all, a list 0,3, a range 0-7 or every N-th ::8; the "
        "others run only the wrapped hook (no copy, no file).",
    ),
]
Compression = Annotated[
    str,
    typer.Option(
        "--compression",
        help="Lossless HDF5 compression: none, gzip, lzf, or lz4 / zstd (need hdf5plugin).",
    ),
]
MaxBytes = Annotated[
    str | None,
    typer.Option(
        "--max-bytes",
        help="Refuse to start if the capture would exceed this size, e.g. 500MB, 20GiB, 1.5TB.",
    ),
]
BatchSize = Annotated[int, typer.Option("--batch-size", help="Per-learner batch size.")]
Lr = Annotated[
    float | None,
    typer.Option(
        "--lr",
        help="SGD learning rate, momentum 0.9 (default: 0.002 for resnet50, 0.01 for gpt2, "
        "0.05 for the others).",
    ),
]
TrainingSeed = Annotated[int, typer.Option("--seed", help="Seed of weights, shards and batches.")]
Size = Annotated[
    str | None,
    typer.Option(
        "--size",
        help="Model size: tiny, small, medium or large (default: large for resnet50, gpt2 "
        "and lstm, the papers' sizes; small for charlm and digits).",
    ),
]
Data = Annotated[
    Path | None,
    typer.Option("--data", help="Text file for the text workloads (charlm, gpt2, lstm)."),
]
CaptureOut = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Capture folder (default: captures/<workload>-<timestamp>)."),
]
NprocPerNode = Annotated[int, typer.Option("--nproc-per-node", help="Learners on this machine.")]
Nnodes = Annotated[int, typer.Option("--nnodes", help="Machines in the run (multi-node).")]
NodeRank = Annotated[int, typer.Option("--node-rank", help="This machine's rank (multi-node).")]
MasterAddr = Annotated[
    str | None, typer.Option("--master-addr", help="Rendezvous host (multi-node).")
]
MasterPort = Annotated[
    int | None, typer.Option("--master-port", help="Rendezvous port (multi-node).")
]
JoinTimeout = Annotated[
    float,
    typer.Option(
        "--join-timeout", help="Seconds to wait for the other nodes before giving up (multi-node)."
    ),
]
Backend = Annotated[
    str, typer.Option("--backend", help="auto (nccl with enough GPUs, else gloo), gloo or nccl.")
]
CommHook = Annotated[
    str,
    typer.Option("--comm-hook", help="The DDP hook gradstat wraps: allreduce, fp16 or powersgd."),
]
Compressor = Annotated[
    str | None,
    typer.Option(
        "--compressor",
        callback=list_compressors,
        is_eager=True,
        help="Train with this compressor as the DDP hook (with --fsdp: inside each unit's "
        "reduce-scatter) and record what each learner sent too (docs/online.md): "
        f"{COMPRESSOR_NAMES}",
    ),
]
Ratio = Annotated[
    float | None, typer.Option("--ratio", help="Density k/d of a --compressor sparsifier.")
]
Fsdp = Annotated[
    bool,
    typer.Option(
        "--fsdp",
        help="Train with FSDP2 (fully_shard per transformer block / ResNet bottleneck, then "
        "the root) instead of DDP; records each learner's gradient before the "
        "reduce-scatter (docs/capture.md, FSDP).",
    ),
]
Hsdp = Annotated[
    int,
    typer.Option(
        "--hsdp",
        metavar="R",
        help="With --fsdp: HSDP, R replicas of learners/R sharding learners each (a "
        "(R, learners/R) mesh): each unit reduce-scatters in its shard group, then the "
        "shards are all-reduced over the replicas (by FSDP, dense; with a --compressor "
        "by gradstat, both stages compressed).",
    ),
]
