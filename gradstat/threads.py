"""The CPUs, threads and torchrun environment of gradstat's processes (read without
importing torch): one torch thread each unless ``GRADSTAT_THREADS``.

Torch's intra-op threads wait for each other at every op's barrier; on a shared machine
one descheduled thread stalls the rest (figures: docs/large.md). Analyses run their
units on :func:`unit_threads` torch threads and get their parallelism from ``--jobs``
worker processes and torchrun ranks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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


def launched_by_torchrun() -> bool:
    """Whether this process is one of several ranks started by torchrun."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    except ValueError:
        return False


def local_processes() -> int:
    """How many gradstat processes share this node: torchrun's LOCAL_WORLD_SIZE, else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


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
    import torch

    previous = torch.get_num_threads()
    if threads != previous:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
