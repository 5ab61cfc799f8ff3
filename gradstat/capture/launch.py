"""Launching a built-in capture the way users launch training: ``torch.distributed.run``.

The launcher validates every option before any process starts, runs torchrun with one
worker per learner, follows the node's first learner's progress lines, keeps all other
output in ``<run>/capture.log`` (``capture-node<K>.log`` on node K > 0, see
gradstat/capture/nodes.py), and turns a failed worker, a node that never joins, a full
disk or Ctrl-C into one clear error.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gradstat.atomic import free_text
from gradstat.cancel import stopped_text
from gradstat.capture import checkpoint
from gradstat.capture.budget import CapturePlan, budget_problem, free_bytes
from gradstat.capture.follow import CaptureLog, Follower, stop
from gradstat.capture.hook_setup import select_named_parameters
from gradstat.capture.nodes import DEFAULT_JOIN_TIMEOUT, check_folder, log_name
from gradstat.capture.worker import LAUNCHER_PID_ENV
from gradstat.capture.workloads import build_workload, default_lr, resolve_size, workload_spec
from gradstat.errors import DataError, GradstatError, Interrupted, UsageError
from gradstat.store.compression import dataset_filters
from gradstat.store.ranks import parse_ranks
from gradstat.store.schema import MAX_LEARNERS, ROOT_FILE, SUPPORTED_DTYPES, rank_file_name
from gradstat.threads import available_cpus, worker_environment

LOG_FILE = log_name(0)
#: Learners (processes) one node may start: more is a typo, not a machine.
MAX_LEARNERS_PER_NODE = 1024
BACKENDS = ("auto", "gloo", "nccl")
COMM_HOOKS = ("allreduce", "fp16", "powersgd")
RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")
EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception): ")
#: torchrun's failure summary: a learner's rank, then its exit code (-N: signal N).
SUMMARY_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
SUMMARY_SIGNAL = re.compile(r"^\s*exitcode\s*:\s*-(\d+)")
ROOT_CAUSE = re.compile(r"^\s*Root Cause")


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
    compressor: str | None = None
    ratio: float | None = None
    record_ranks: str = "all"
    compression: str = "none"
    max_bytes: int | None = None
    fsdp: bool = False  # FSDP2 (fully_shard per block) instead of DDP
    hsdp: int = 1  # with fsdp: replicas of an HSDP mesh (1: shard over every learner)
    warmup_steps: int = 0  # steps trained unrecorded before the --steps recorded ones
    save: Path | None = None  # a checkpoint written at the end (capture/checkpoint.py)
    resume: Path | None = None  # a checkpoint to continue from
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    command: str = field(default_factory=lambda: " ".join(["gradstat", *sys.argv[1:]]))

    def check(self) -> None:
        """Refuse, as a ``UsageError`` naming the option, any setting that cannot run."""
        self._check_counts()
        spec = workload_spec(self.workload)
        resolve_size(self.workload, self.size)
        choices = {
            "--dtype": (self.dtype, SUPPORTED_DTYPES),
            "--backend": (self.backend, BACKENDS),
            "--comm-hook": (self.comm_hook, COMM_HOOKS),
        }
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise UsageError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.fsdp:
            self._check_fsdp()
        elif self.hsdp != 1:
            raise UsageError("--hsdp shapes an FSDP2 mesh: add --fsdp")
        if self.compressor is not None:
            self._check_compressor()
        elif self.ratio is not None:
            raise UsageError("--ratio applies to --compressor only")
        self._check_backend()
        if self.data is not None:
            if not spec.takes_data:
                raise UsageError(f"--data applies to the text workloads only, not {self.workload}")
            if not Path(self.data).is_file():
                raise UsageError(f"--data {self.data}: no such file")
        if self.nnodes > 1 and not (self.master_addr and self.master_port):
            raise UsageError("multi-node runs need --master-addr and --master-port")
        if self.out is not None and Path(self.out).exists() and not Path(self.out).is_dir():
            raise UsageError(f"--out {self.out} is a file; give a folder for the capture")
        if self.layers:
            try:
                re.compile(self.layers)
            except re.error as exc:
                raise UsageError(f"--layers {self.layers!r} is not a valid regex: {exc}") from None
        parse_ranks(self.record_ranks, self.world_size)
        dataset_filters(self.compression)  # a known name, with its plugin installed
        self._check_checkpoints()

    def _check_checkpoints(self) -> None:
        """``--save`` and ``--resume``: DDP runs only (FSDP2 shards the state), no
        compressor's memory to lose, a writable file, a checkpoint of this very run."""
        if self.save is None and self.resume is None:
            return
        if self.fsdp:
            raise UsageError("--save and --resume keep DDP runs' state; drop --fsdp")
        if self.save is not None:
            if self.compressor is not None:
                raise UsageError(
                    "--save keeps no compressor's error-feedback memory; train the "
                    "checkpoint without --compressor (a resumed run may use one)"
                )
            checkpoint.check_save(self.save)
        if self.resume is not None:
            checkpoint.check_resume(self.resume, self.identity())

    def identity(self) -> dict:
        """What a checkpoint of this run shares with the run that resumes it."""
        data = str(Path(self.data).resolve()) if self.data is not None else None
        size = resolve_size(self.workload, self.size)
        return checkpoint.run_identity(
            self.workload, size, data, self.seed, self.batch_size, self.world_size
        )

    def _check_counts(self) -> None:
        """The numbers: counts at least 1, a first step that is recorded, a node rank
        among the nodes, a positive learning rate, join timeout and size limit."""
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
        if self.nproc_per_node > MAX_LEARNERS_PER_NODE:
            raise UsageError(
                f"--nproc-per-node must be at most {MAX_LEARNERS_PER_NODE} (one process per "
                f"learner), got {self.nproc_per_node}"
            )
        if self.world_size > MAX_LEARNERS:
            raise UsageError(
                f"--nnodes x --nproc-per-node must be at most {MAX_LEARNERS:,} learners, "
                f"got {self.world_size:,}"
            )
        if self.start < 0:
            raise UsageError(f"--start must be at least 0, got {self.start}")
        if self.warmup_steps < 0:
            raise UsageError(f"--warmup-steps must be at least 0, got {self.warmup_steps}")
        if self.start >= self.steps:
            raise UsageError(
                f"--start {self.start} is past the last step ({self.steps - 1}): "
                "nothing would be recorded"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.lr is not None and not self.lr > 0:
            raise UsageError(f"--lr must be positive, got {self.lr}")
        if not self.join_timeout > 0:
            raise UsageError(f"--join-timeout must be positive, got {self.join_timeout:g}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise UsageError(f"--max-bytes must be positive, got {self.max_bytes}")

    def _check_backend(self) -> None:
        """``--backend nccl`` needs a visible GPU per learner on this machine."""
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise UsageError("--backend nccl needs CUDA GPUs; none is visible (use gloo)")
        if self.backend == "nccl" and self.nproc_per_node > torch.cuda.device_count():
            raise UsageError(
                f"--nproc-per-node {self.nproc_per_node} exceeds the "
                f"{torch.cuda.device_count()} visible GPUs"
            )

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
            sent=self.compressor is not None,
        )

    def _check_fsdp(self) -> None:
        """``--fsdp`` trains without a DDP hook (``--compressor`` runs inside each unit's
        reduce-scatter instead)."""
        from gradstat.capture.fsdp import check_fsdp_support

        if self.comm_hook != "allreduce":
            raise UsageError("--comm-hook wraps a DDP hook; under --fsdp drop it")
        world = self.world_size
        if self.hsdp < 1 or world % self.hsdp or world // self.hsdp < 2:
            raise UsageError(
                f"--hsdp {self.hsdp}: the replicas must divide the {world} learners into "
                "shard groups of at least 2 (one replica per learner is DDP: drop --fsdp)"
            )
        check_fsdp_support()

    def _check_compressor(self) -> None:
        """``--compressor NAME[:PARAM=VALUE]`` with ``--ratio`` for sparsifiers."""
        from gradstat.compressors.spec import parse_compressors

        specs = parse_compressors(self.compressor or "")
        if len(specs) != 1:
            raise UsageError("--compressor takes one compressor")
        if self.comm_hook != "allreduce":
            raise UsageError("--compressor replaces --comm-hook: give one of them")
        if self.layers:
            raise UsageError("--compressor compresses the whole model: drop --layers")
        if self.backend == "nccl":
            raise UsageError("--compressor runs its collectives on gloo: use --backend gloo")
        if specs[0].fixed_rate:
            if self.ratio is not None:
                raise UsageError(f"{specs[0].name} has a fixed rate: drop --ratio")
        elif self.ratio is None or not 0.0 < self.ratio < 1.0:
            raise UsageError(f"{specs[0].name} is a sparsifier: give --ratio in (0, 1)")

    @property
    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        if self.compressor is not None:
            return "gloo"
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
        "compressor": options.compressor,
        "ratio": options.ratio,
        "record_ranks": options.record_ranks,
        "compression": options.compression,
        "fsdp": options.fsdp,
        "hsdp": options.hsdp,
        "warmup": options.warmup_steps,
        "save": str(Path(options.save).resolve()) if options.save is not None else None,
        "resume": str(Path(options.resume).resolve()) if options.resume is not None else None,
        "command": options.command,
    }
    argv += ["-m", "gradstat.capture.worker", "--config", json.dumps(config)]
    return argv


def worker_env(options: CaptureOptions) -> dict[str, str]:
    # never oversubscribed: each learner gets its share of the CPUs this process may use
    # (GRADSTAT_THREADS overrides); OMP_NUM_THREADS also silences torchrun's warning
    # the learners end when this launcher is gone (killed too)
    threads = os.environ.get("GRADSTAT_THREADS") or available_cpus() // options.nproc_per_node
    return {**worker_environment(max(1, int(threads))), LAUNCHER_PID_ENV: str(os.getpid())}


def failure_reason(lines: deque[str]) -> str:
    """A learner killed by a signal (torchrun's summary: the others then only report the
    lost connection), else the worker's own ``Error:`` line, else the last exception line
    a learner printed. torchrun lists the other failures first and its root cause (the
    first failure observed) last: a learner killed by SIGKILL is named, not the
    SIGTERM torchrun sent the others after it."""
    lines = list(lines)
    root = [i for i, line in enumerate(lines) if ROOT_CAUSE.match(line)]
    killed = _killed_learner(lines[root[-1] :] if root else lines)
    if killed is not None:  # else the root cause exited: its own error line names it
        return killed
    section = lines[root[-1] :] if root else []
    ranks = [int(m.group(1)) for line in section if (m := SUMMARY_RANK.match(line))]
    culprit = f"[rank{ranks[0]}]:" if ranks else "["
    texts = [RANK_PREFIX.sub("", line).strip() for line in lines]
    worker_lines = [
        t
        for line, t in zip(lines, texts, strict=True)
        if RANK_PREFIX.match(line) and line.startswith(culprit)
    ]
    for text in reversed(texts):
        if text.startswith("Error:"):
            return text[len("Error:") :].strip()
    for text in reversed(worker_lines or texts):
        if EXCEPTION_LINE.match(text):
            return text
    return "a learner failed"


def _killed_learner(lines: list[str]) -> str | None:
    """The first learner of torchrun's summary ``lines`` that a signal ended, or None."""
    rank = None
    for line in lines:
        if match := SUMMARY_RANK.match(line):
            rank = int(match.group(1))
        elif (match := SUMMARY_SIGNAL.match(line)) and rank is not None:
            number = int(match.group(1))
            name = signal.Signals(number).name if number in signal.valid_signals() else "?"
            return f"learner {rank} died (signal {number}, {name})"
    return None


def check_budget(options: CaptureOptions, run_dir: Path) -> tuple[CapturePlan, int]:
    """The capture's plan and the free space; ``UsageError`` when it would not fit."""
    plan = options.plan()
    free = free_bytes(run_dir)
    problem = budget_problem(plan, free, options.max_bytes)
    if problem is not None:
        raise UsageError(problem)
    return plan, free


def recorded(run_dir: Path) -> tuple[int, int, str, str | None] | None:
    """``(steps, learners, status, stop reason)`` committed in ``run_dir``, or ``None``
    where this node holds no ``capture.h5`` (a node > 0 without a shared folder)."""
    from gradstat.store.reader import Capture

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Capture(run_dir, allow_damaged=True) as cap:
                return len(cap.steps), len(cap.learners), cap.status, cap.stop_reason
    except GradstatError:
        return None


def _interrupted_text(run_dir: Path) -> str:
    state = recorded(run_dir)
    if state is None:
        return f"{stopped_text()}; the rank files in {run_dir} keep every committed row"
    steps, learners, _, _ = state
    return (
        f"{stopped_text()}; {steps} steps x {learners} learners committed in {run_dir} "
        f"(readable: gradstat info {run_dir})"
    )


def _is_part(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a complete ``capture.h5`` but only some of the rank files
    it lists: node 0's part of a multi-node capture written to folders of their own (the
    node's output says to join the parts with ``gradstat merge``)."""
    import h5py

    try:
        with h5py.File(run_dir / ROOT_FILE, "r") as f:
            status = f.attrs.get("status")
            ranks = [int(r) for r in f.attrs["recorded_ranks"]]
    except (OSError, KeyError, TypeError, ValueError):
        return False
    present = [(run_dir / rank_file_name(r)).exists() for r in ranks]
    return status == "complete" and any(present) and not all(present)


def _check_recorded(run_dir: Path, node_rank: int, nnodes: int, log: CaptureLog) -> None:
    """After torchrun succeeded: a capture that is not complete here (a writer stopped on
    a full disk, the root could not be finalised) is an error saying what is there, the
    free space and the command that reads it."""
    state = recorded(run_dir)
    free = f"{free_text(run_dir)} in {run_dir}"
    if state is None:
        if node_rank > 0 and not (run_dir / ROOT_FILE).exists():
            return  # a node > 0 writing its own folder: node 0 holds capture.h5
        if nnodes > 1 and _is_part(run_dir):
            return  # node 0's own folder: the other nodes' rank files are elsewhere
        raise DataError(
            f"capture failed: {run_dir / ROOT_FILE} cannot be read after training ({free}"
            f"{log.note()}); the rank files keep every committed row"
        )
    steps, learners, status, reason = state
    if status != "complete":
        why = reason or f"{status}: capture.h5 was not finalised"
        raise DataError(
            f"capture incomplete ({why}; {free}{log.note()}): {steps} steps x {learners} "
            f"learners recorded in {run_dir}, readable up to there (gradstat info {run_dir})"
        )


def run_capture(
    options: CaptureOptions,
    on_progress: Callable[[dict], None] | None = None,
    on_warning: Callable[[str], None] | None = None,
    on_wait: Callable[[str], None] | None = None,
    on_plan: Callable[[CapturePlan, int], None] | None = None,
) -> Path:
    """Run the capture; returns the run folder.

    Raises ``UsageError`` (before any process starts) if the capture would not fit on
    disk, ``DataError`` if training fails, a node does not join within
    ``options.join_timeout`` or a writer stopped early, and ``Interrupted`` on Ctrl-C,
    each saying what was committed where.
    """
    options.check()
    run_dir = options.run_dir()
    check_folder(run_dir, options.node_rank)
    plan, free = check_budget(options, run_dir)
    if on_plan is not None:
        on_plan(plan, free)
    log_path = run_dir / log_name(options.node_rank)
    argv = torchrun_argv(options, run_dir)
    with _claim(run_dir, log_path) as log:
        log.write("$ " + shlex.join(argv) + "\n")
        log.flush()
        process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=worker_env(options),
        )
        callbacks = (on_progress, on_warning, on_wait)
        follower = Follower(process, log, run_dir, options, *callbacks)
        try:
            code = follower.follow()
        except KeyboardInterrupt:
            stop(process)
            raise Interrupted(_interrupted_text(run_dir)) from None
        except BaseException:
            stop(process)
            raise
    if code != 0:
        reason = failure_reason(follower.tail)
        raise DataError(f"capture failed: {reason} (full log: {log_path}{log.note()})")
    _check_recorded(run_dir, options.node_rank, options.nnodes, log)
    return run_dir


def _claim(run_dir: Path, log_path: Path) -> CaptureLog:
    """The new log file, opened for writing: creating it (``O_EXCL``) claims the folder,
    so that of two captures started into one folder only one runs."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return CaptureLog(open(log_path, "x"))
    except FileExistsError:
        raise UsageError(
            f"{run_dir} is being written by another capture (its {log_path.name} appeared "
            "just now); choose another --out"
        ) from None
    except OSError as exc:  # e.g. a read-only file system
        raise UsageError(f"--out {run_dir}: cannot write there ({exc.strerror})") from None
