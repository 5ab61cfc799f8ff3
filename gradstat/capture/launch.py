"""Launching a built-in capture the way users launch training: ``torch.distributed.run``.

The launcher validates every option before any process starts, runs torchrun with one
worker per learner, follows rank 0's progress lines, keeps all other output in
``<run>/capture.log``, and turns a failed worker into one clear error.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gradstat.capture.budget import CapturePlan, budget_problem, free_bytes
from gradstat.capture.hook import select_named_parameters
from gradstat.capture.worker import PROGRESS_PREFIX
from gradstat.capture.workloads import build_workload, default_lr, resolve_size, workload_spec
from gradstat.errors import DataError, UsageError
from gradstat.parallel.threads import available_cpus, worker_environment
from gradstat.store.compression import dataset_filters
from gradstat.store.ranks import parse_ranks
from gradstat.store.schema import ROOT_FILE, SUPPORTED_DTYPES

LOG_FILE = "capture.log"
PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>
BACKENDS = ("auto", "gloo", "nccl")
COMM_HOOKS = ("allreduce", "fp16", "powersgd")
RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")
EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception): ")


@dataclass
class CaptureOptions:
    """Everything ``gradstat capture`` needs; validated by :meth:`check`."""

    workload: str = "charlm"
    steps: int = 100
    out: Path | None = None
    every: int = 1
    start: int = 0
    layers: str | None = None
    dtype: str = "float32"
    batch_size: int = 32
    lr: float | None = None  # the workload's default learning rate
    seed: int = 0
    size: str | None = None  # the workload's default size
    data: Path | None = None
    nproc_per_node: int = 2
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    backend: str = "auto"
    comm_hook: str = "allreduce"
    record_ranks: str = "all"
    compression: str = "none"
    max_bytes: int | None = None
    command: str = field(default_factory=lambda: " ".join(["gradstat", *sys.argv[1:]]))

    def check(self) -> None:
        positive = {
            "--steps": self.steps,
            "--every": self.every,
            "--batch-size": self.batch_size,
            "--nproc-per-node": self.nproc_per_node,
            "--nnodes": self.nnodes,
        }
        for name, value in positive.items():
            if value < 1:
                raise UsageError(f"{name} must be at least 1, got {value}")
        if self.start < 0:
            raise UsageError(f"--start must be at least 0, got {self.start}")
        if self.start >= self.steps:
            raise UsageError(
                f"--start {self.start} is past the last step ({self.steps - 1}): "
                "nothing would be recorded"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.lr is not None and not self.lr > 0:
            raise UsageError(f"--lr must be positive, got {self.lr}")
        spec = workload_spec(self.workload)
        resolve_size(self.workload, self.size)
        if self.dtype not in SUPPORTED_DTYPES:
            raise UsageError(
                f"--dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}"
            )
        if self.backend not in BACKENDS:
            raise UsageError(
                f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        if self.comm_hook not in COMM_HOOKS:
            raise UsageError(
                f"--comm-hook must be one of {', '.join(COMM_HOOKS)}, got {self.comm_hook!r}"
            )
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise UsageError("--backend nccl needs CUDA GPUs; none is visible (use gloo)")
        if self.backend == "nccl" and self.nproc_per_node > torch.cuda.device_count():
            raise UsageError(
                f"--nproc-per-node {self.nproc_per_node} exceeds the "
                f"{torch.cuda.device_count()} visible GPUs"
            )
        if self.data is not None:
            if not spec.takes_data:
                raise UsageError(f"--data applies to the text workloads only, not {self.workload}")
            if not Path(self.data).is_file():
                raise UsageError(f"--data {self.data}: no such file")
        if self.nnodes > 1 and not (self.master_addr and self.master_port):
            raise UsageError("multi-node runs need --master-addr and --master-port")
        if self.layers:
            try:
                re.compile(self.layers)
            except re.error as exc:
                raise UsageError(f"--layers {self.layers!r} is not a valid regex: {exc}") from None
        parse_ranks(self.record_ranks, self.world_size)
        dataset_filters(self.compression)  # a known name, with its plugin installed
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise UsageError(f"--max-bytes must be positive, got {self.max_bytes}")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def plan(self) -> CapturePlan:
        """What this machine's learners will write (the model is built on the meta
        device: shapes only, no memory)."""
        with torch.device("meta"):
            model = build_workload(self.workload, self.size, self.data).model
        named = select_named_parameters(model, self.layers)
        first = self.node_rank * self.nproc_per_node
        local = set(range(first, first + self.nproc_per_node))
        recorded = parse_ranks(self.record_ranks, self.world_size)
        return CapturePlan(
            rows=self.recorded_steps,
            learners=len(local.intersection(recorded)),
            numel=sum(param.numel() for _, param in named),
            dtype=self.dtype,
            layers=len(named),
            root=self.node_rank == 0,
        )

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return (
            "nccl"
            if torch.cuda.is_available() and torch.cuda.device_count() >= self.nproc_per_node
            else "gloo"
        )

    def run_dir(self) -> Path:
        if self.out is not None:
            return Path(self.out)
        return Path("captures") / f"{self.workload}-{time.strftime('%Y%m%d-%H%M%S')}"

    @property
    def recorded_steps(self) -> int:
        return len(range(self.start, self.steps, self.every))


def torchrun_argv(options: CaptureOptions, run_dir: Path) -> list[str]:
    """The ``python -m torch.distributed.run ... -m gradstat.capture.worker ...`` command."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(options.nproc_per_node),
    ]
    if options.nnodes == 1 and not options.master_addr:
        argv.append("--standalone")
    else:
        argv += [
            "--nnodes",
            str(options.nnodes),
            "--node-rank",
            str(options.node_rank),
            "--master-addr",
            str(options.master_addr),
            "--master-port",
            str(options.master_port),
        ]
    config = {
        "workload": options.workload,
        "size": options.size,
        "data": str(Path(options.data).resolve()) if options.data is not None else None,
        "out": str(run_dir),
        "steps": options.steps,
        "every": options.every,
        "start": options.start,
        "layers": options.layers,
        "dtype": options.dtype,
        "batch_size": options.batch_size,
        "lr": options.lr if options.lr is not None else default_lr(options.workload),
        "seed": options.seed,
        "backend": options.resolved_backend,
        "comm_hook": options.comm_hook,
        "record_ranks": options.record_ranks,
        "compression": options.compression,
        "command": options.command,
    }
    argv += ["-m", "gradstat.capture.worker", "--config", json.dumps(config)]
    return argv


def _worker_env(options: CaptureOptions) -> dict[str, str]:
    # never oversubscribed: each learner gets its share of the CPUs this process may use
    # (GRADSTAT_THREADS overrides); OMP_NUM_THREADS also silences torchrun's warning
    threads = os.environ.get("GRADSTAT_THREADS") or available_cpus() // options.nproc_per_node
    return worker_environment(max(1, int(threads)))


def _progress_report(line: str) -> dict | None:
    """Rank 0's progress report, or None for any other line (kept in the log)."""
    if not line.startswith(PROGRESS_PREFIX):
        return None
    try:
        report = json.loads(line[len(PROGRESS_PREFIX) :])
    except json.JSONDecodeError:
        return None
    return report if isinstance(report, dict) else None


def _stop_with_parent() -> None:
    """Have torchrun receive SIGTERM if the launcher dies, even by SIGKILL (Linux), so
    that no learner keeps training unobserved; torchrun then stops its workers."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _failure_reason(lines: deque[str]) -> str:
    """The worker's own ``Error:`` line, else the last exception line a learner printed."""
    texts = [RANK_PREFIX.sub("", line).strip() for line in lines]
    worker_lines = [t for line, t in zip(lines, texts, strict=True) if RANK_PREFIX.match(line)]
    for text in reversed(texts):
        if text.startswith("Error:"):
            return text[len("Error:") :].strip()
    for text in reversed(worker_lines or texts):
        if EXCEPTION_LINE.match(text):
            return text
    return "a learner failed"


def check_budget(options: CaptureOptions, run_dir: Path) -> tuple[CapturePlan, int]:
    """The capture's plan and the free space; ``UsageError`` when it would not fit."""
    plan = options.plan()
    free = free_bytes(run_dir)
    problem = budget_problem(plan, free, options.max_bytes)
    if problem is not None:
        raise UsageError(problem)
    return plan, free


def run_capture(
    options: CaptureOptions,
    on_progress: Callable[[dict], None] | None = None,
    on_warning: Callable[[str], None] | None = None,
    on_plan: Callable[[CapturePlan, int], None] | None = None,
) -> Path:
    """Run the capture; returns the run folder. Raises ``DataError`` if training fails,
    ``UsageError`` (before any process starts) if the capture would not fit on disk."""
    options.check()
    run_dir = options.run_dir()
    if (run_dir / ROOT_FILE).exists() or (run_dir.exists() and any(run_dir.iterdir())):
        raise UsageError(
            f"{run_dir} already exists and is not empty; choose another --out or remove it"
        )
    plan, free = check_budget(options, run_dir)
    if on_plan is not None:
        on_plan(plan, free)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / LOG_FILE
    argv = torchrun_argv(options, run_dir)
    seen_warnings: set[str] = set()
    tail: deque[str] = deque(maxlen=200)
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(argv) + "\n")
        process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_worker_env(options),
            preexec_fn=_stop_with_parent,
        )
        try:
            assert process.stdout is not None
            for line in process.stdout:
                report = _progress_report(line)
                if report is not None:
                    if on_progress is not None:
                        on_progress(report)
                    continue
                log.write(line)
                tail.append(line)
                if line.startswith("Warning:") and on_warning is not None:
                    message = line[len("Warning:") :].strip()
                    if message not in seen_warnings:
                        seen_warnings.add(message)
                        on_warning(message)
            code = process.wait()
        except BaseException:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
            raise
    if code != 0:
        raise DataError(f"capture failed: {_failure_reason(tail)} (full log: {log_path})")
    return run_dir
