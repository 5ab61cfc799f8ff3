"""One learner of a built-in capture run; started by ``torch.distributed.run``.

``gradstat capture`` launches one of these per learner. Rank 0 reports progress to the
launcher as ``gradstat-progress`` lines on stdout; warnings go to stderr as
``Warning: ...`` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradstat.capture import checkpoint
from gradstat.capture.hook import GradientCapture
from gradstat.capture.workloads import build_workload, fully_shard_workload, resolve_size
from gradstat.errors import GradstatError

PROGRESS_PREFIX = "gradstat-progress "
#: The launcher's process id, in the learners' environment: they end when it is gone.
LAUNCHER_PID_ENV = "GRADSTAT_LAUNCHER_PID"
#: Seconds between a learner's looks at torchrun and the launcher.
WATCH_EVERY = 0.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker takes one ``--config JSON`` argument (written by the launcher).

    A single argument keeps torchrun's own option parsing (which matches abbreviations
    such as ``--start`` for ``--start-method``) away from the worker's options.
    """
    parser = argparse.ArgumentParser(prog="gradstat-worker")
    parser.add_argument("--config", required=True, help="JSON object of worker settings")
    config = json.loads(parser.parse_args(argv).config)
    config["out"] = Path(config["out"])
    config["data"] = Path(config["data"]) if config.get("data") else None
    return argparse.Namespace(**config)


def _inner_hook(name: str, process_group):
    """The user-facing ``--comm-hook`` choices: PyTorch's own hooks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "allreduce":
        return default_hooks.allreduce_hook, None
    if name == "fp16":
        return default_hooks.fp16_compress_hook, process_group
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=process_group, matrix_approximation_rank=2, start_powerSGD_iter=2
        )
        return powerSGD_hook.powerSGD_hook, state
    raise GradstatError(f"unknown comm hook {name!r}")


def _compression_hook(spec: str, ratio: float | None, seed: int, fsdp: bool, hsdp: int):
    """``--compressor SPEC`` (a registry name or the user's own, with its parameters):
    gradstat's hook for that compressor (under ``--fsdp`` its state alone: it runs
    inside each unit's reduce-scatter, one message per unit, and with ``--hsdp`` R > 1
    in the replicate stage too)."""
    from gradstat.hooks import compression_hook

    if fsdp:
        options = {"seed": seed, "granularity": "unit", "replicate": hsdp}
        return None, compression_hook(spec, ratio=ratio, **options)[1]
    return compression_hook(spec, ratio=ratio, seed=seed)


def train(args: argparse.Namespace) -> None:
    """One learner of ``gradstat capture``: join the process group, build the workload
    and its DDP (or FSDP2) model, train ``args.steps`` steps under a ``GradientCapture``;
    each node's first learner prints progress lines for the launcher."""
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    reporter = local_rank == 0  # each node's launcher follows its first learner
    if reporter:  # every node has joined: the launcher stops its --join-timeout clock
        emit_line(sys.stdout, PROGRESS_PREFIX + json.dumps({"joined": world}))
    if args.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP broadcasts them too)
    workload = build_workload(args.workload, args.size, args.data)
    ddp = _parallel_model(args, workload.model.to(device), device, local_rank, world)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    first = 0  # the training step this run starts at (a checkpoint's, with --resume)
    if args.resume:
        first = checkpoint.restore(args.resume, workload.model, optimizer, args.lr)
    batches = workload.batches(rank, world, args.batch_size, args.seed)
    checkpoint.advance(batches, first)
    capture = _capture(args, ddp, workload, first)
    started = time.perf_counter()
    for i in range(args.warmup + args.steps):
        inputs, targets = next(batches)
        loss = workload.loss(
            ddp(inputs.to(device, non_blocking=True)), targets.to(device, non_blocking=True)
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_value = loss.item()
        capture.step(first + i, loss_value)
        if reporter:
            _report(i + 1, loss_value, capture, time.perf_counter() - started)
    if args.save:
        following = first + args.warmup + args.steps
        checkpoint.save(args.save, workload.model, optimizer, following, run_identity(args, world))
    capture.close()
    dist.destroy_process_group()
    exit_without_teardown()


def _report(done: int, loss: float, capture: GradientCapture, elapsed: float) -> None:
    """The progress line the launcher follows: steps of this run done, the last loss,
    what the capture wrote so far, seconds since training started."""
    report = {
        "step": done,
        "loss": loss,
        "bytes": capture.bytes_written,
        "rows": capture.rows_written,
        "elapsed": elapsed,
    }
    emit_line(sys.stdout, PROGRESS_PREFIX + json.dumps(report))


def _parallel_model(
    args: argparse.Namespace,
    model: torch.nn.Module,
    device: torch.device,
    local_rank: int,
    world: int,
) -> torch.nn.Module:
    """``model`` under FSDP2 (``args.fsdp``: fully_shard per block, then the root; on a
    ``(replicate, shard)`` mesh of ``args.hsdp`` replicas when above 1; with a
    ``--compressor`` on its shard dim alone, gradstat running the replicate stage) or
    DistributedDataParallel (on this learner's GPU under NCCL)."""
    if getattr(args, "fsdp", False):
        from torch.distributed.device_mesh import init_device_mesh

        replicas = getattr(args, "hsdp", 1)
        if replicas > 1:
            shape, names = (replicas, world // replicas), ("replicate", "shard")
            mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
            if getattr(args, "compressor", None):  # both stages compressed, by gradstat
                mesh = mesh["shard"]
        else:
            mesh = init_device_mesh(device.type, (world,))
        return fully_shard_workload(args.workload, model, mesh)
    ids = [local_rank] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def run_identity(args: argparse.Namespace, world: int) -> dict:
    """What a checkpoint of this run and a run resuming it share (checkpoint.py)."""
    data = str(args.data) if args.data is not None else None
    size = resolve_size(args.workload, args.size)
    return checkpoint.run_identity(args.workload, size, data, args.seed, args.batch_size, world)


def _capture(
    args: argparse.Namespace, ddp: torch.nn.Module, workload, first: int
) -> GradientCapture:
    """The ``GradientCapture`` of the run: the hook asked for (``--comm-hook``, or the
    ``--compressor`` trained with), the options and the workload's metadata. It records
    from the ``--start``-th step after the warm-up; ``first``: the training step the run
    starts at (a resumed checkpoint's)."""
    fsdp = getattr(args, "fsdp", False)
    hook, hook_state = (None, None) if fsdp else _inner_hook(args.comm_hook, None)
    if getattr(args, "compressor", None):
        hsdp = getattr(args, "hsdp", 1)
        hook, hook_state = _compression_hook(args.compressor, args.ratio, args.seed, fsdp, hsdp)
    meta = {
        "workload": args.workload,
        "workload_description": workload.description,
        "size": workload.size,
        "lr": args.lr,
        "seed": args.seed,
        "steps_requested": args.steps,
        "warmup_steps": args.warmup,
        "resumed_at": first,
        "resumed_from": args.resume or "",
        "comm_hook": "fsdp2-reduce-scatter" if fsdp else args.comm_hook,
        "command": args.command or " ".join(sys.argv),
    }
    return GradientCapture(
        ddp,
        args.out,
        every=args.every,
        start=args.warmup + args.start,
        batch_size=args.batch_size,
        layers=args.layers,
        dtype=args.dtype,
        hook=hook,
        hook_state=hook_state,
        meta=meta,
        record_ranks=args.record_ranks,
        compression=args.compression,
    )


def exit_without_teardown(code: int = 0) -> None:
    """Leave without the interpreter's teardown, once every file is closed.

    Two libraries can crash in their static destructors at exit although all work is
    done: gloo now and then aborts ("terminate called without an active exception",
    also without gradstat: about 1 run in 20 here), and HDF5 may fail to close a file it
    could not extend after a full disk. Everything committed is on disk by now.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def emit_line(stream: TextIO, text: str) -> None:
    """Write one whole line in a single write: all learners share torchrun's output pipe,
    and a line written in pieces could interleave with another learner's."""
    stream.write(text.replace("\n", " ") + "\n")
    stream.flush()


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    emit_line(sys.stderr, f"Warning: {message}")


def _die_with_launcher() -> None:
    """torchrun starts each learner in a session of its own, so a learner would train on
    unobserved if torchrun or the launcher were killed: a daemon thread ends this
    learner within ``WATCH_EVERY`` seconds of either being gone."""
    parent, launcher = os.getppid(), int(os.environ.get(LAUNCHER_PID_ENV, "0"))

    def watch() -> None:
        while True:
            time.sleep(WATCH_EVERY)
            if os.getppid() != parent or (launcher and not _alive(launcher)):
                os._exit(1)

    threading.Thread(target=watch, name="gradstat-watch-launcher", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        return True
    return True


def main(argv: list[str] | None = None) -> None:
    _die_with_launcher()
    warnings.showwarning = _warning_line
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    args = parse_args(argv)
    threads = int(os.environ.get("GRADSTAT_THREADS", "0"))
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        train(args)
    except GradstatError as exc:
        emit_line(sys.stderr, f"Error: {exc}")
        sys.exit(1)


if __name__ == "__main__":
    main()
