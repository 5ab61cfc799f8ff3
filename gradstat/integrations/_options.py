"""What the framework callbacks share: ``GradientCapture``'s options kept until the
framework has wrapped the model in ``DistributedDataParallel`` (or sharded it with FSDP2's
``fully_shard``), and the loss as a float."""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from gradstat.capture.fsdp import fsdp_units
from gradstat.capture.hook import GradientCapture
from gradstat.errors import UsageError


class DeferredCapture:
    """A ``GradientCapture`` to start once the framework hands over its DDP model.

    ``options`` are ``GradientCapture``'s keyword arguments (``every``, ``start``,
    ``layers``, ``dtype``, ``hook``, ``hook_state``, ``meta``, ...), checked by name now so
    that a typo fails before training starts.
    """

    def __init__(self, out_dir: str | Path, framework: str, options: Mapping[str, Any]) -> None:
        try:
            inspect.signature(GradientCapture).bind(None, out_dir, **options)
        except TypeError as exc:
            raise UsageError(f"GradientCapture option: {exc}") from None
        self.out_dir = Path(out_dir)
        self.framework = framework
        self.options = dict(options)
        self.capture: GradientCapture | None = None

    def start(self, model: object) -> GradientCapture:
        if not isinstance(model, DistributedDataParallel) and not fsdp_units(model):
            raise UsageError(
                f"gradstat records DistributedDataParallel or FSDP2 (fully_shard) training: "
                f"run {self.framework} with a DDP or FSDP2 strategy and 2 or more processes "
                f"(the model is a {type(model).__name__})"
            )
        options = dict(self.options)
        meta = {"workload": self.framework, **(options.pop("meta", None) or {})}
        self.capture = GradientCapture(model, self.out_dir, meta=meta, **options)
        return self.capture

    def step(self, step: int, loss: float) -> None:
        if self.capture is not None:
            self.capture.step(step, loss)

    def close(self) -> None:
        """Flush and finalise (collective: every rank must call it)."""
        if self.capture is not None:
            self.capture.close()

    def abandon(self, exception: BaseException) -> None:
        """After a failure: flush what is committed, leave the capture readable, and talk
        to no other rank (they may be gone)."""
        if self.capture is not None:
            self.capture.__exit__(type(exception), exception, exception.__traceback__)


def loss_value(value: object) -> float:
    """A loss as a float (NaN where there is none): a tensor, a number or ``{"loss": ...}``."""
    if isinstance(value, Mapping):
        value = value.get("loss")
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan
