"""Built-in workloads: real models on real data that ships with Python packages.

Each workload gives a model and, per learner, an endless stream of batches drawn from
that learner's own shard of the data, so learners' gradients differ as in real
data-parallel training. Nothing is downloaded: weights are random, the data is
scikit-learn's digits or the Python standard library's own sources (or ``--data FILE``).

Every workload comes in four sizes. The toy workloads (``charlm``, ``digits``) default to
``small``; the realistic ones (``resnet50``, ``gpt2``, ``lstm``) default to ``large``, the
size the gradient-compression papers measured, and keep small sizes for tests and demos.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

import torch
from torch import nn

from gradstat.errors import UsageError

Batch = tuple[torch.Tensor, torch.Tensor]
SIZE_NAMES = ("tiny", "small", "medium", "large")
SIZES = {"tiny": 0.5, "small": 1.0, "medium": 2.0, "large": 4.0}  # charlm/digits scales


@dataclass
class Workload:
    """A model, a per-learner batch stream and the loss."""

    name: str
    size: str
    description: str
    model: nn.Module
    batches: Callable[[int, int, int, int], Iterator[Batch]]  # (rank, world, batch, seed)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class WorkloadSpec:
    """What ``--list-workloads`` shows, and where the workload is built.

    ``module`` names a module of this package with ``build(size, data) -> Workload`` and
    ``model(size) -> nn.Module`` (the model alone, at its nominal vocabulary), so that
    listing the workloads builds no data and imports nothing heavy.
    """

    name: str
    module: str
    default_size: str
    data: str
    description: str
    takes_data: bool = False
    lr: float = 0.05  # SGD (momentum 0.9) learning rate that does not diverge at batch 8
    #: ``--fsdp``: the module lists whose members each become an FSDP unit (dotted
    #: paths), as users shard them: transformer blocks, ResNet bottlenecks, the LSTM
    fsdp_blocks: tuple[str, ...] = ()


_TEXT = "stdlib bytes or --data"
SPECS = {
    spec.name: spec
    for spec in (
        WorkloadSpec(
            "charlm",
            "charlm",
            "small",
            _TEXT,
            "byte transformer LM",
            True,
            fsdp_blocks=("blocks.layers",),
        ),
        WorkloadSpec("digits", "digits", "small", "sklearn digits 8x8", "small CNN"),
        WorkloadSpec(
            "resnet50",
            "resnet",
            "large",
            "sklearn digits 32x32 RGB",
            "ResNet-50 (torchvision's)",
            lr=0.002,
            fsdp_blocks=("layer1", "layer2", "layer3", "layer4"),
        ),
        WorkloadSpec(
            "gpt2",
            "gpt2",
            "large",
            _TEXT,
            "GPT-2-small-shaped decoder",
            True,
            lr=0.01,
            fsdp_blocks=("h",),
        ),
        WorkloadSpec(
            "lstm", "lstm", "large", "stdlib words or --data", "2-layer LSTM LM (PTB)", True
        ),
    )
}


def workload_names() -> list[str]:
    return list(SPECS)


def workload_spec(name: str) -> WorkloadSpec:
    if name not in SPECS:
        raise UsageError(f"unknown workload {name!r}; choose one of {', '.join(SPECS)}")
    return SPECS[name]


def resolve_size(name: str, size: str | None) -> str:
    """``size``, checked, or the workload's default size when ``size`` is None."""
    if size is None:
        return workload_spec(name).default_size
    if size not in SIZE_NAMES:
        raise UsageError(f"unknown --size {size!r}; choose one of {', '.join(SIZE_NAMES)}")
    return size


def default_lr(name: str) -> float:
    return workload_spec(name).lr


def build_workload(name: str, size: str | None = None, data: Path | None = None) -> Workload:
    """The workload ``name`` at ``size`` (its default size when None)."""
    spec = workload_spec(name)
    size = resolve_size(name, size)
    if data is not None and not spec.takes_data:
        texts = ", ".join(s.name for s in SPECS.values() if s.takes_data)
        raise UsageError(f"--data applies to the text workloads only ({texts})")
    module = import_module(f"{__name__}.{spec.module}")
    return module.build(size, data) if spec.takes_data else module.build(size)


def parameter_count(name: str, size: str | None = None) -> int:
    """Parameters of the workload's model, counted on the meta device (no memory, no data)."""
    spec = workload_spec(name)
    module = import_module(f"{__name__}.{spec.module}")
    with torch.device("meta"):
        model = module.model(resolve_size(name, size))
    return sum(p.numel() for p in model.parameters())


def fully_shard_workload(name: str, model: nn.Module, mesh) -> nn.Module:
    """``--fsdp``: ``fully_shard`` on each block of the workload (``fsdp_blocks``), then
    on the root (which keeps the rest: embeddings, norms, heads, tied weights)."""
    from torch.distributed.fsdp import fully_shard

    for path in workload_spec(name).fsdp_blocks:
        for block in model.get_submodule(path).children():
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
