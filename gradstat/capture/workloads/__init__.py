"""Built-in workloads: real models on real data that ships with Python packages.

Each workload gives a model and, per learner, an endless stream of batches drawn from
that learner's own shard of the data, so learners' gradients differ as in real
data-parallel training.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gradstat.errors import UsageError

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Workload:
    """A model factory, a per-learner batch stream and the loss."""

    name: str
    description: str
    model: nn.Module
    batches: Callable[[int, int, int, int], Iterator[Batch]]  # (rank, world, batch, seed)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


SIZES = {"tiny": 0.5, "small": 1.0, "medium": 2.0, "large": 4.0}


def workload_names() -> list[str]:
    return ["charlm", "digits"]


def build_workload(name: str, size: str = "small", data: Path | None = None) -> Workload:
    """The workload ``name`` at a size (``tiny``, ``small``, ``medium``, ``large``)."""
    if size not in SIZES:
        raise UsageError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    if name == "digits":
        from gradstat.capture.workloads.digits import digits_workload

        if data is not None:
            raise UsageError("--data applies to the charlm workload only")
        return digits_workload(SIZES[size])
    if name == "charlm":
        from gradstat.capture.workloads.charlm import charlm_workload

        return charlm_workload(SIZES[size], data)
    raise UsageError(f"unknown workload {name!r}; choose one of {', '.join(workload_names())}")
