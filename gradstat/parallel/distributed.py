"""Analyses under torchrun: rank 0 runs the command, the other ranks compute units.

``torchrun --nproc-per-node 2 -m gradstat similarity CAP`` starts the command in every
rank; :func:`run_command` joins a gloo group from torchrun's environment. Each time rank
0 reaches ``run_units`` it broadcasts the request, every rank computes its contiguous
run of the units (:func:`share`) from the shared capture, and rank 0 gathers the
outcomes; at the end it broadcasts a stop. Only rank 0 prints or writes files, so its
output is the single-process output. Objects cross ranks with torch.distributed's
object collectives (pickles between gradstat's own ranks).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradstat.threads import launched_by_torchrun

#: How long a rank waits at a collective (torchrun stops the others when one dies).
TIMEOUT = timedelta(hours=24)
_STOP = "stop"


def active() -> bool:
    """Whether a process group is running (units are split across ranks)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def run_command(command: Callable[[], Any], follow: Callable[[Any], dict]) -> Any:
    """``command()`` on rank 0; the other ranks answer each request with
    ``follow(request)`` and return 0. Outside torchrun: just ``command()``."""
    if active():
        return _lead_or_follow(command, follow)
    if not launched_by_torchrun():
        return command()
    dist.init_process_group("gloo", timeout=TIMEOUT)
    if torch.cuda.is_available():  # --device cuda: each rank of a node on its own GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    try:
        return _lead_or_follow(command, follow)
    finally:
        dist.destroy_process_group()


def _lead_or_follow(command: Callable[[], Any], follow: Callable[[Any], dict]) -> Any:
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - rank 0 reports
        if os.environ.get("GRADSTAT_DEBUG") != "1":
            sys.stderr = sys.stdout
        while (request := _broadcast(None)) != _STOP:
            dist.gather_object(follow(request), None, dst=0)
        return 0
    try:
        return command()
    finally:
        _broadcast(_STOP)


def _broadcast(document: Any) -> Any:
    box = [document]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def share(count: int) -> list[int]:
    """This rank's unit indices: the rank-th of ``world_size`` contiguous runs (sizes
    within one), so neighbouring units that share a step meet in one rank."""
    rank, size = (dist.get_rank(), world_size()) if active() else (0, 1)
    return list(range(count * rank // size, count * (rank + 1) // size))


def exchange(request: Any, compute: Callable[[Any], dict]) -> dict:
    """Rank 0: send ``request``, compute this rank's share, gather every outcome."""
    _broadcast(request)
    outcomes = compute(request)
    gathered: list[Any] = [None] * world_size()
    dist.gather_object({}, gathered, dst=0)
    for part in gathered:
        outcomes.update(part)
    return outcomes
