"""PyTorch Lightning: ``GradstatCallback`` records each learner's local gradient.

    from gradstat.integrations.lightning import GradstatCallback

    callback = GradstatCallback("captures/run", every=10)
    trainer = L.Trainer(strategy="ddp", devices=4, callbacks=[callback])

At fit start the callback registers ``GradientCapture`` on the strategy's DDP model
(``trainer.strategy.model``); it calls ``step`` once per optimizer step (Lightning
accumulates gradients under ``no_sync``, so the accumulated gradient is recorded) with
the training step's loss, and closes the capture at fit end. After an exception the
capture keeps every committed step and stays readable.

With ``ModelParallelStrategy`` (FSDP2: ``fully_shard`` in ``configure_model``) the
callback records the sharded model the same way; that strategy reduce-scatters every
micro-batch, so under ``accumulate_grad_batches`` rows hold the last micro-batch's
gradient (with a warning) unless sync is turned off on the others (docs/integrations.md).

Lightning ignores ``DDPStrategy(ddp_comm_hook=...)`` on CPU; pass your own hook to the
callback instead (``hook=``, ``hook_state=``), which works on every device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradstat.integrations._options import DeferredCapture, loss_value

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package
    try:
        import pytorch_lightning as pl
    except ImportError:
        raise ImportError(
            "gradstat.integrations.lightning needs Lightning: pip install 'gradstat[lightning]'"
        ) from None


class GradstatCallback(pl.Callback):
    """Record local gradients of Lightning's DDP (or FSDP2) training into ``out_dir``.

    Keyword arguments are ``GradientCapture``'s: ``every``, ``start`` (both count
    optimizer steps, i.e. ``step()`` calls, from 0 at fit start: not the step numbers
    recorded), ``layers``, ``dtype``, ``hook``, ``hook_state``, ``meta``, ...
    Rows are numbered with ``trainer.global_step`` before the step.
    """

    def __init__(self, out_dir: str | Path, **capture_options: Any) -> None:
        super().__init__()
        self._deferred = DeferredCapture(out_dir, "lightning", capture_options)
        self._global_step = 0

    @property
    def capture(self):
        """The running ``GradientCapture`` (None before fit start)."""
        return self._deferred.capture

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._deferred.start(trainer.strategy.model)
        self._global_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx
    ) -> None:
        # global_step counts optimizer steps: it moves only after an accumulation window
        if trainer.global_step != self._global_step:
            self._deferred.step(self._global_step, loss_value(outputs))
            self._global_step = trainer.global_step

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._deferred.close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._deferred.abandon(exception)
