"""Checkpoints of the built-in workloads: ``gradstat capture --save`` and ``--resume``.

A checkpoint is one ``torch.save`` file that rank 0 writes at the end of a run (to a
temporary name, then renamed: a run stopped while saving leaves the old file whole):
the model's and the optimizer's state dicts, the next training step, every learner's
torch RNG state, and what the run must share with a run that continues it (workload,
size, data, seed, per-learner batch size, learners). Each learner's data position is
its count of batches drawn, one per step: a resumed learner rebuilds its batch stream
and draws that many batches first, so it continues exactly where the saved run stopped
(the tests check that a resumed run records the very gradients of an unbroken one).

Files are read with ``torch.load(weights_only=True)``: tensors and plain values only, no
code runs. The launcher reads a checkpoint's header before any learner starts
(:func:`check_resume`), so a mismatch is one usage error, not a failed run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradstat.errors import DataError, UsageError

FORMAT = "gradstat-checkpoint"
VERSION = 1
#: What a resumed run must share with the saved one, as (key, option) pairs.
SHARED = (
    ("workload", "--workload"),
    ("size", "--size"),
    ("data", "--data"),
    ("seed", "--seed"),
    ("batch_size", "--batch-size"),
    ("world_size", "learners (--nproc-per-node x --nnodes)"),
)


def run_identity(
    workload: str, size: str, data: str | None, seed: int, batch_size: int, world: int
) -> dict:
    """The settings a checkpoint and the run that resumes it must share."""
    return {
        "workload": workload,
        "size": size,
        "data": data,
        "seed": seed,
        "batch_size": batch_size,
        "world_size": world,
    }


def read(path: Path) -> dict:
    """A checkpoint file's contents (tensors mapped, not read); ``DataError`` when it is
    not one, ``UsageError`` when there is no such file."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--resume {path}: no such file")
    try:
        found = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # torch raises many kinds for a file that is not its own
        raise DataError(
            f"--resume {path}: not a readable checkpoint ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(found, dict) or found.get("format") != FORMAT:
        raise DataError(f"--resume {path}: not a gradstat checkpoint (written by capture --save)")
    if found.get("version") != VERSION:
        raise DataError(
            f"--resume {path}: checkpoint version {found.get('version')!r}; this gradstat "
            f"reads version {VERSION}"
        )
    return found


def check_resume(path: Path, identity: dict) -> int:
    """The step a checkpoint continues from; a ``UsageError`` naming the option that
    differs from the saved run's."""
    found = read(path)
    for key, option in SHARED:
        if found.get(key) != identity[key]:
            raise UsageError(
                f"--resume {path}: the checkpoint was saved with {key} {found.get(key)!r}, "
                f"this run has {identity[key]!r}; give the same {option} to continue it"
            )
    return int(found["step"])


def check_save(path: Path) -> None:
    """``--save``: a file path in an existing folder that this process may write."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"--save {path} is a folder; give a file name, e.g. {path / 'state.pt'}")
    if not path.parent.is_dir():
        raise UsageError(f"--save {path}: no such folder {path.parent}")
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"--save {path}: cannot write in {path.parent}")


def save(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, identity: dict
) -> None:
    """Collective: gather every learner's RNG state; rank 0 writes the checkpoint of
    ``model`` (the module under DDP) and ``optimizer`` continuing at ``step``."""
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, torch.get_rng_state())
    if dist.get_rank() != 0:
        return
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    contents = {
        "format": FORMAT,
        "version": VERSION,
        **identity,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": states,
    }
    try:
        torch.save(contents, temporary)
        os.replace(temporary, path)
    except OSError as exc:
        raise DataError(
            f"--save {path}: cannot write the checkpoint ({exc.strerror or exc})"
        ) from None
    finally:
        temporary.unlink(missing_ok=True)


def restore(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float) -> int:
    """Load a checkpoint into ``model`` and ``optimizer`` (its learning rate set to
    ``lr``, this run's), this learner's RNG state; the step it continues from."""
    found = read(path)
    model.load_state_dict(found["model"])
    optimizer.load_state_dict(found["optimizer"])
    for group in optimizer.param_groups:
        group["lr"] = lr
    torch.set_rng_state(found["rng"][dist.get_rank()].clone())
    return int(found["step"])


def advance(batches: Iterator[Any], count: int) -> None:
    """Draw ``count`` batches: the data position of a learner that trained ``count`` steps."""
    for _ in range(count):
        next(batches)
