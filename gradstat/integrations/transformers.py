"""Hugging Face ``Trainer``: one line records each learner's local gradient.

    from gradstat.integrations.transformers import attach

    trainer = Trainer(model=model, args=args, train_dataset=data)
    attach(trainer, "captures/run", every=10)
    trainer.train()

The Trainer's callbacks see only the unwrapped model, so :func:`attach` hands the
callback the trainer itself: at train begin it registers ``GradientCapture`` on
``trainer.model_wrapped`` (the ``DistributedDataParallel`` model that accelerate made),
calls ``step`` once per optimizer step (the Trainer accumulates under ``no_sync``), and
closes the capture at train end. The recorded loss is the step's training loss as
``Trainer.training_step`` returns it (summed over the accumulated micro-batches, which
the Trainer has each divided by their count: the step's mean loss).

gradstat records the local gradient before the all-reduce, so before the Trainer's
gradient clipping (``max_grad_norm``) too.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gradstat.integrations._options import DeferredCapture, loss_value

try:
    from transformers import Trainer, TrainerCallback
except ImportError:
    raise ImportError(
        "gradstat.integrations.transformers needs transformers: "
        "pip install 'gradstat[transformers]'"
    ) from None


class GradstatCallback(TrainerCallback):
    """Records local gradients of ``trainer``'s DDP training into ``out_dir``.

    Prefer :func:`attach`, which also adds the callback and records the loss. Keyword
    arguments are ``GradientCapture``'s: ``every``, ``start`` (both count optimizer steps,
    i.e. ``step()`` calls from 0 at train begin: not the step numbers recorded), ``layers``,
    ``dtype``, ``hook``, ``hook_state``, ``meta``, ... Rows are numbered with the
    Trainer's ``global_step`` before the step.
    """

    def __init__(self, trainer: Trainer, out_dir: str | Path, **capture_options: Any) -> None:
        self.trainer = trainer
        self._deferred = DeferredCapture(out_dir, "transformers", capture_options)
        self._losses: list[float] = []

    @property
    def capture(self):
        """The running ``GradientCapture`` (None before training begins)."""
        return self._deferred.capture

    def add_loss(self, loss: object) -> None:
        """One micro-batch's loss as ``Trainer.training_step`` returned it."""
        self._losses.append(loss_value(loss))

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self._deferred.start(self.trainer.model_wrapped)
        self._losses = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        # called once per optimizer step, after global_step was increased
        loss = math.fsum(self._losses) if self._losses else math.nan  # NaN: not known
        self._deferred.step(state.global_step - 1, loss)
        self._losses = []

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._deferred.close()


def attach(trainer: Trainer, out_dir: str | Path, **capture_options: Any) -> GradstatCallback:
    """Record ``trainer``'s local gradients into ``out_dir``; returns the callback.

    Adds a :class:`GradstatCallback` and wraps this trainer's ``training_step`` (only on
    this instance) to pass each micro-batch's loss to it.
    """
    callback = GradstatCallback(trainer, out_dir, **capture_options)
    trainer.add_callback(callback)
    training_step = trainer.training_step

    def training_step_with_loss(*args: Any, **kwargs: Any):
        loss = training_step(*args, **kwargs)
        callback.add_loss(loss)
        return loss

    trainer.training_step = training_step_with_loss
    return callback
