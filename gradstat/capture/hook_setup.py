"""What ``GradientCapture`` (gradstat/capture/hook.py) checks and decides when it is made.

Which parameters it records and in what order, the ``fully_shard`` units of an FSDP2
model, what it refuses (a DDP model with a hook already, an FSDP unit replicated without
sharding), the capture's identity shared by all ranks and the metadata rank 0 writes to
``capture.h5`` (docs/format.md).
"""

import json
import re
import socket
import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradstat import __version__
from gradstat.capture import fsdp
from gradstat.errors import UsageError
from gradstat.store.compression import check_compression
from gradstat.store.dtypes import check_dtype
from gradstat.store.schema import BATCH_SIZE_ATTR, Layer, layer_table, new_run_id


def check_settings(
    every: int, start: int, dtype: str | None, compression: str, batch_size: int | None = None
) -> None:
    """A ``UsageError`` for a recording interval under 1, a negative first step, an
    unknown storage dtype (None: the default) or compression, or a batch size that is not
    a positive integer."""
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise UsageError(f"batch_size must be a positive integer, got {batch_size!r}")
    if every < 1:
        raise UsageError(f"every must be >= 1, got {every}")
    if start < 0:
        raise UsageError(f"start must be >= 0, got {start}")
    if dtype is not None:
        check_dtype(dtype)
    check_compression(compression)


def select_named_parameters(
    module: torch.nn.Module, pattern: str | None
) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable parameters whose name matches ``pattern`` (all when None), in order."""
    try:
        regex = re.compile(pattern) if pattern else None
    except re.error as exc:
        raise UsageError(f"layers {pattern!r} is not a valid regex: {exc}") from None
    named = [
        (name, param)
        for name, param in module.named_parameters()
        if param.requires_grad and (regex is None or regex.search(name))
    ]
    if not named:
        raise UsageError(f"layers {pattern!r} matches no trainable parameter")
    return named


def select_parameters(
    model: DistributedDataParallel | torch.nn.Module, pattern: str | None
) -> tuple[list[Layer], list[torch.nn.Parameter]]:
    """The layer table of the recorded parameters (``pattern`` as above) and the
    parameters themselves, in the same order: the order of the flat row."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    named = select_named_parameters(module, pattern)
    return layer_table([(name, tuple(p.shape)) for name, p in named]), [p for _, p in named]


def capture_units(model: torch.nn.Module, hook: Any, hook_state: Any) -> list:
    """The model's ``fully_shard`` units; [] for DDP; a ``UsageError`` for anything else,
    for a DDP ``hook`` passed with FSDP, and for a model another capture records."""
    if isinstance(model, DistributedDataParallel):
        return []
    units = fsdp.fsdp_units(model)
    if not units:
        raise UsageError(
            f"GradientCapture records DistributedDataParallel or fully_shard (FSDP2) "
            f"models; this is a {type(model).__name__} with neither"
        )
    fsdp.check_fsdp_support()
    compressing = hasattr(hook_state, "bind_for_fsdp")  # gradstat's compression hook
    if not compressing and (hook is not None or hook_state is not None):
        raise UsageError(
            "hook= and hook_state= wrap a DDP communication hook; under FSDP2 gradstat "
            "wraps each unit's reduce-scatter (set yours with set_custom_reduce_scatter "
            "before GradientCapture, and it runs after the recording)"
        )
    if any(fsdp.is_wrapped(unit) for unit in units):
        raise UsageError("this FSDP model already records into a GradientCapture")
    return units


def check_layouts(layouts: list[tuple[Any, fsdp.UnitLayout]]) -> None:
    """On every rank, before any unit is touched: the FSDP units gradstat cannot record."""
    for _, layout in layouts:
        if layout.shard == 1 and layout.replicate > 1:
            raise UsageError(
                f"FSDP unit {layout.name} is replicated over {layout.replicate} learners "
                "without sharding (a mesh whose shard dim has size 1): its local "
                "gradient never reaches a reduce-scatter; record it under DDP instead"
            )


def check_no_comm_hook(model: DistributedDataParallel) -> None:
    """DDP takes one communication hook; gradstat's must wrap any other."""
    registered = [getattr(h, "__qualname__", repr(h)) for h, _ in model._comm_hooks]
    builtin = model._get_ddp_logging_data().get("comm_hook", "")
    names = registered or ([builtin] if builtin else [])
    if names:
        raise UsageError(
            f"the DDP model already has a communication hook ({names[0]}); gradstat "
            "wraps your hook instead: register none and pass it as "
            "GradientCapture(ddp, out_dir, hook=your_hook, hook_state=its_state)"
        )


def shared_run_id(
    rank: int, process_group: dist.ProcessGroup | None, device: torch.device | None
) -> str:
    """Rank 0's new capture identity, sent to every rank (it ties rank files to their
    capture.h5; docs/format.md, Integrity). Collective; ``device`` is the GPU of an
    NCCL group, else None."""
    ids = [new_run_id() if rank == 0 else None]
    source = 0 if process_group is None else dist.get_global_rank(process_group, 0)
    dist.broadcast_object_list(ids, src=source, group=process_group, device=device)
    return str(ids[0])


def capture_metadata(
    data_parallel: str,
    process_group: dist.ProcessGroup | None,
    meta: Mapping[str, Any] | None,
    every: int,
    start: int,
    layers: str | None,
    compression: str,
    batch_size: int | None = None,
) -> dict:
    """The attributes of ``capture.h5``: how the run was recorded (``data_parallel``
    ``ddp`` or ``fsdp2``, the backend, ``every``, ``start``, the ``layers`` regex,
    ``compression``, the per-learner ``batch_size`` when given), where and by what, then
    the caller's ``meta``, which wins (a ``batch_size`` there must agree)."""
    if batch_size is not None and (meta or {}).get(BATCH_SIZE_ATTR, batch_size) != batch_size:
        raise UsageError(
            f"batch_size={batch_size} but meta has batch_size={meta[BATCH_SIZE_ATTR]!r}"
        )
    versions = {
        "torch": torch.__version__,
        "gradstat": __version__,
        "python": sys.version.split()[0],
    }
    return {
        "workload": "custom",
        "data_parallel": data_parallel,
        "backend": dist.get_backend(process_group),
        "every": every,
        "start": start,
        "layers_regex": layers or "",
        "compression": compression,
        **({} if batch_size is None else {BATCH_SIZE_ATTR: batch_size}),
        "hostname": socket.gethostname(),
        "command": " ".join(sys.argv),
        "versions": json.dumps(versions),
        **(meta or {}),
    }
