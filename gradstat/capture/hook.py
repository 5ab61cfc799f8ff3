"""``GradientCapture``: a DDP communication hook that records local gradients.

It wraps the user's own hook (default: PyTorch's plain all-reduce) the way
``torch.distributed.algorithms.ddp_comm_hooks`` hooks are written: a small hook function
with an explicit state object. On every bucket of a recorded step it copies the
bucket's per-parameter gradients (the learner's local gradient, before the all-reduce)
into one flat buffer in parameter order, *before* the inner hook may change the bucket
in place (the fp16 hook divides it, PowerSGD overwrites it). Parameters are looked up
on every call, since DDP rebuilds its buckets after the first iteration.

Usage in a training script (one object per process)::

    ddp = DistributedDataParallel(model)
    with GradientCapture(ddp, "captures/run1", every=10) as capture:
        for step, batch in enumerate(loader):
            loss = criterion(ddp(batch.x), batch.y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            capture.step(step, loss.item())

Call ``step`` once per optimizer step. Under ``no_sync()`` gradient accumulation DDP
runs no hook until the synchronising backward, so the accumulated gradient is recorded.
"""

import json
import re
import socket
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from gradstat import __version__
from gradstat.capture.writer_thread import BackgroundWriter, PendingRow, compression_meta
from gradstat.errors import GradstatWarning, UsageError
from gradstat.store.schema import SUPPORTED_DTYPES, Layer, layer_table, rank_file_name
from gradstat.store.writer import finalize_root, write_root

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def _capture_hook(
    capture: "GradientCapture", bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Record the bucket (on recorded steps), then run the wrapped hook.

    Annotations are real objects (no postponed evaluation in this module): DDP checks
    that a hook's bucket argument is annotated ``dist.GradBucket``.
    """
    if capture.recording:
        capture._record_bucket(bucket)
    inner_state = capture.hook_state
    if capture.hook is allreduce_hook and inner_state is None:
        inner_state = capture.process_group
    return capture.hook(inner_state, bucket)


class GradientCapture:
    """Record each learner's local gradient to ``out_dir/rank-NNNNN.h5`` during training.

    Args:
        model: the DistributedDataParallel model (the hook is registered on it).
        out_dir: the capture folder; rank 0 also writes ``capture.h5`` there.
        every: record every ``every``-th step, starting at ``start``.
        layers: regex of parameter names to record (default: all trainable ones).
        dtype: ``float32`` or ``float16`` on disk.
        hook, hook_state: the communication hook to wrap and its state
            (default: plain all-reduce), e.g. PyTorch's ``fp16_compress_hook`` or
            ``powerSGD_hook`` with a ``PowerSGDState``, or gradstat's own
            ``gradstat.hooks.compression_hook``: then each learner's contribution after
            compression is recorded too, as the ``sent`` dataset (docs/online.md).
        meta: extra attributes for ``capture.h5`` (workload, command line, ...).
        max_queue: rows that may wait for the writer before training blocks.
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        out_dir: str | Path,
        *,
        every: int = 1,
        start: int = 0,
        layers: str | None = None,
        dtype: str = "float32",
        hook: CommHook | None = None,
        hook_state: Any = None,
        meta: Mapping[str, Any] | None = None,
        max_queue: int = 4,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if every < 1:
            raise UsageError(f"every must be >= 1, got {every}")
        if start < 0:
            raise UsageError(f"start must be >= 0, got {start}")
        if dtype not in SUPPORTED_DTYPES:
            raise UsageError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {dtype!r}")
        self.every, self.start = every, start
        self.hook = hook or allreduce_hook
        self.hook_state = hook_state
        self.process_group = process_group
        self.out_dir = Path(out_dir)
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.layers, params = self._select_parameters(model, layers)
        self.numel = self.layers[-1].stop
        self._slots = {
            param: (layer.offset, layer.numel)
            for param, layer in zip(params, self.layers, strict=True)
        }
        self._device = params[0].device
        self._storage_dtype = getattr(torch, dtype)
        self._pool: list[torch.Tensor] = []
        self._pool_lock = threading.Lock()
        self._iteration = 0
        self._pending: torch.Tensor | None = None
        self._copied = 0
        self._closed = False
        # a gradstat compression hook: bind it to the model, record what it sent
        self._records_sent = hasattr(hook_state, "bind_for_capture")
        if self._records_sent:
            hook_state.bind_for_capture(model.module, layers)
            meta = {**(meta or {}), **compression_meta(hook_state)}

        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            write_root(
                self.out_dir,
                self.layers,
                self.world_size,
                dtype,
                self._metadata(meta, every, start, layers),
            )
        self.writer = BackgroundWriter(
            self.out_dir / rank_file_name(self.rank),
            self.rank,
            self.numel,
            dtype,
            self._release,
            max_queue,
            sent=self._records_sent,
        )
        model.register_comm_hook(self, _capture_hook)

    # --- set-up -----------------------------------------------------------------------
    @staticmethod
    def _select_parameters(
        model: DistributedDataParallel, pattern: str | None
    ) -> tuple[list[Layer], list]:
        try:
            regex = re.compile(pattern) if pattern else None
        except re.error as exc:
            raise UsageError(f"layers {pattern!r} is not a valid regex: {exc}") from None
        named = [
            (name, param)
            for name, param in model.module.named_parameters()
            if param.requires_grad and (regex is None or regex.search(name))
        ]
        if not named:
            raise UsageError(f"layers {pattern!r} matches no trainable parameter")
        return layer_table([(name, tuple(p.shape)) for name, p in named]), [p for _, p in named]

    def _metadata(
        self, meta: Mapping[str, Any] | None, every: int, start: int, layers: str | None
    ) -> dict:
        versions = {
            "torch": torch.__version__,
            "gradstat": __version__,
            "python": sys.version.split()[0],
        }
        return {
            "workload": "custom",
            "backend": dist.get_backend(self.process_group),
            "every": every,
            "start": start,
            "layers_regex": layers or "",
            "hostname": socket.gethostname(),
            "command": " ".join(sys.argv),
            "versions": json.dumps(versions),
            **(meta or {}),
        }

    # --- buffers ----------------------------------------------------------------------
    def _acquire(self) -> torch.Tensor:
        with self._pool_lock:
            if self._pool:
                return self._pool.pop()
        pinned = self._device.type == "cuda"
        return torch.empty(self.numel, dtype=self._storage_dtype, pin_memory=pinned)

    def _release(self, buffer: torch.Tensor) -> None:
        with self._pool_lock:
            self._pool.append(buffer)

    # --- recording --------------------------------------------------------------------
    @property
    def recording(self) -> bool:
        """Whether the current iteration is one that gets recorded."""
        it = self._iteration
        return (
            not self._closed
            and not self.writer.failed
            and it >= self.start
            and (it - self.start) % self.every == 0
        )

    def _record_bucket(self, bucket: dist.GradBucket) -> None:
        if self._pending is None:
            self._pending = self._acquire()
            self._copied = 0
        non_blocking = self._device.type == "cuda"
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            slot = self._slots.get(param)
            if slot is not None:
                offset, numel = slot
                self._pending[offset : offset + numel].copy_(
                    grad.reshape(-1), non_blocking=non_blocking
                )
                self._copied += numel

    def step(self, step: int | None = None, loss: float | None = None) -> None:
        """Finish the current optimizer step: hand a recorded row to the writer."""
        if self._pending is not None:
            ready = None
            if self._device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
            row_step = self._iteration if step is None else int(step)
            row_loss = float("nan") if loss is None else float(loss)
            if self._copied == self.numel:
                row = PendingRow(row_step, row_loss, self._pending, ready)
                if self._records_sent:
                    row.sent, row.sent_bytes = self._sent_row()
                self.writer.submit(row)
            else:  # a step without a (complete) backward: nothing consistent to record
                self._release(self._pending)
            self._pending = None
        self._iteration += 1

    def _sent_row(self) -> tuple[torch.Tensor, float]:
        """The compression hook's contribution of this step, in the capture's dtype."""
        sent = self._acquire()
        sent.copy_(self.hook_state.sent)
        return sent, float(self.hook_state.payload_bytes)

    def close(self) -> None:
        """Flush the writer; rank 0 marks the capture complete once every rank is done.

        Collective: call it on every rank.
        """
        if self._closed:
            return
        self._closed = True
        self.writer.close()
        failed = torch.tensor([float(self.writer.failed)], device=self._device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.process_group)
        if self.rank == 0:
            complete = failed.item() == 0
            try:  # virtual datasets only over rank files that closed cleanly
                finalize_root(
                    self.out_dir, "complete" if complete else "incomplete", virtual=complete
                )
            except Exception as exc:
                warnings.warn(
                    f"gradstat could not finalise {self.out_dir}: {exc}",
                    GradstatWarning,
                    stacklevel=2,
                )
        # every rank returns once the capture is final, and no rank tears down its
        # process group while another still talks to it
        dist.barrier(group=self.process_group)

    def __enter__(self) -> "GradientCapture":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # leave the capture readable up to its last committed step
            self._closed = True
            self.writer.close()
