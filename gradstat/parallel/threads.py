"""The thread policy: one torch thread per process, parallelism across units in processes.

Measured on a shared 2-core machine (``benchmarks/parallel.py`` and issue 9): torch's
intra-op threads speed single large element-wise ops up by at most 1.1-2x on a quiet
machine, but when another process competes for the cores, ops on vectors of 2^17-2^20
elements ran 2-100x *slower* on two threads than on one (the threads wait for each
other at every op's barrier while one of them is descheduled). Worker processes that each
use one thread lose only their fair share of the machine instead. So every analysis runs
its units on one torch thread per process and gets its parallelism from ``--jobs``
worker processes (and torchrun ranks); ``GRADSTAT_THREADS=N`` overrides the per-process
count for whoever has measured that more helps on their machine.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from gradstat.errors import UsageError

#: Environment variable that overrides the per-process torch thread count.
THREADS_ENV = "GRADSTAT_THREADS"


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def local_processes() -> int:
    """How many gradstat processes share this node: torchrun's LOCAL_WORLD_SIZE, else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def default_jobs() -> int:
    """Worker processes per gradstat process: this node's CPUs over its gradstat ranks."""
    return max(1, available_cpus() // local_processes())


def check_jobs(jobs: int | None) -> int:
    """``jobs`` validated (``None``: :func:`default_jobs`)."""
    if jobs is None:
        return default_jobs()
    if jobs < 1:
        raise UsageError(f"jobs must be at least 1, got {jobs}")
    return jobs


def unit_threads() -> int:
    """Torch threads a process uses for analysis units: 1 unless ``GRADSTAT_THREADS``."""
    value = os.environ.get(THREADS_ENV, "")
    try:
        return max(1, int(value)) if value else 1
    except ValueError:
        raise UsageError(f"{THREADS_ENV}={value!r}: expected a positive integer") from None


def worker_environment(threads: int) -> dict[str, str]:
    """Environment of a child process that should use ``threads`` CPU threads: OpenMP,
    MKL and OpenBLAS pools sized before they start (torch reads OMP_NUM_THREADS)."""
    value = str(max(1, threads))
    return {
        **os.environ,
        "OMP_NUM_THREADS": value,
        "MKL_NUM_THREADS": value,
        "OPENBLAS_NUM_THREADS": value,
        THREADS_ENV: value,
    }


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run with ``threads`` torch intra-op threads, then restore the previous count."""
    previous = torch.get_num_threads()
    if threads != previous:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
