"""Analyses under torchrun: rank 0 runs the command, the other ranks compute units.

``torchrun --nproc-per-node 2 -m gradstat similarity CAP --json`` starts the same
command in every rank. :func:`run_command` (called by the CLI entry point) joins a gloo
process group from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``); rank 0 runs the command as one process would, the other ranks never
parse it: they follow. Each time the command reaches :func:`gradstat.parallel.run_units`,
rank 0 broadcasts the request (work, context, units) and every rank computes its
contiguous run of the units (:func:`share`), reading its own steps from the shared capture;
the outcomes are gathered on rank 0 in unit order. When the command ends (success or
error) rank 0 broadcasts a stop. So only rank 0 prints (tables, progress, warnings,
errors) and writes files, and its output is exactly the single-process output.

Everything crosses ranks as JSON bytes in uint8 tensors (broadcast and gather over
gloo), never as pickles (``broadcast_object_list`` / ``gather_object`` unpickle).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gradstat.parallel.codec import decode, encode
from gradstat.parallel.environment import launched_by_torchrun
from gradstat.parallel.pool import contiguous

T = TypeVar("T")

#: How long a rank waits for the others at a collective: units of one request may differ
#: much in cost (a replay of PowerSGD against one of top-k), and a dead rank is noticed
#: by torchrun, which stops the others.
TIMEOUT = timedelta(hours=24)

_STOP = {"stop": True}


def active() -> bool:
    """Whether a gradstat process group is running (units are split across ranks)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def run_command(command: Callable[[], T]) -> T | int:
    """Run ``command`` on rank 0 and follow on the other ranks (0 as their result).

    Under torchrun this joins (and at the end leaves) a gloo process group; in a group
    that is already running (a script that started one) it uses that group; otherwise it
    just runs ``command``."""
    if active():
        return _lead_or_follow(command)
    if not launched_by_torchrun():
        return command()
    dist.init_process_group("gloo", timeout=TIMEOUT)
    if torch.cuda.is_available():  # --device cuda: each rank of a node on its own GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    try:
        return _lead_or_follow(command)
    finally:
        dist.destroy_process_group()


def _lead_or_follow(command: Callable[[], T]) -> T | int:
    if dist.get_rank() != 0:
        _silence()
        _follow()
        return 0
    try:
        return command()
    finally:
        _broadcast(_STOP)


def _silence() -> None:
    """Nothing a following rank might print reaches the terminal (rank 0 reports)."""
    devnull = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    sys.stdout = devnull
    if os.environ.get("GRADSTAT_DEBUG") != "1":
        sys.stderr = devnull


def _broadcast(document: Any) -> Any:
    """Rank 0's ``document`` on every rank (JSON bytes: a length, then the bytes)."""
    data = encode(document) if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0)
    buffer = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if dist.get_rank() == 0
        else torch.empty(int(size), dtype=torch.uint8)
    )
    dist.broadcast(buffer, src=0)
    return decode(buffer.numpy().tobytes())


def _gather(document: Any) -> list[Any] | None:
    """Every rank's ``document`` on rank 0 (in rank order); ``None`` on the others."""
    data = encode(document)
    size = torch.tensor([len(data)], dtype=torch.int64)
    root = dist.get_rank() == 0
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.gather(size, sizes if root else None, dst=0)
    longest = max(int(s) for s in sizes) if root else 0
    longest = _broadcast_int(longest)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buffers = [torch.empty(longest, dtype=torch.uint8) for _ in sizes] if root else None
    dist.gather(padded, buffers, dst=0)
    if not root:
        return None
    assert buffers is not None
    return [decode(b[: int(s)].numpy().tobytes()) for b, s in zip(buffers, sizes, strict=True)]


def _broadcast_int(value: int) -> int:
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(tensor, src=0)
    return int(tensor)


def share(count: int) -> list[int]:
    """The unit indices this rank computes: the ``rank``-th of ``world_size`` contiguous
    runs (sizes within one), so that neighbouring units (overlap's step pairs) that share
    a step meet in one rank."""
    start, stop = contiguous(count, world_size())[rank()]
    return list(range(start, stop))


def exchange(request: dict, compute: Callable[[dict], dict[int, dict]]) -> dict[int, dict]:
    """Rank 0: send ``request`` to every rank, compute this rank's share with ``compute``
    and return every unit's outcome by index (rank 0's own stay in this process)."""
    _broadcast(request)
    outcomes = compute(request)
    gathered = _gather({})
    assert gathered is not None
    outcomes.update((int(i), outcome) for part in gathered for i, outcome in part.items())
    return outcomes


def _follow() -> None:
    """Answer rank 0's requests until it says stop."""
    from gradstat.parallel.runner import compute_share

    while True:
        request = _broadcast(None)
        if request == _STOP:
            return
        _gather({str(i): outcome for i, outcome in compute_share(request).items()})
