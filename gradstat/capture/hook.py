"""``GradientCapture``: records local gradients under DDP (a communication hook) or
FSDP2 (a custom reduce-scatter on every ``fully_shard`` unit, gradstat/capture/fsdp.py).

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
A second backward before ``step`` (accumulation without ``no_sync()``, where DDP
all-reduces every micro-batch, or a skipped ``step`` call) is detected by a bucket that
arrives twice: the row restarts, so it holds the last backward's gradients, and a
warning says what to do, once.

With ``record_ranks`` only a sample of learners records; the others register the wrapped
hook alone (no copy, no buffers, no writer thread, no rank file).

Under FSDP2 pass the model that ``fully_shard`` was applied to (its root and any nested
units): each unit's reduce-scatter input, the unit's unsharded local gradients, is
unpacked into the same flat row. Accumulate with ``model.set_requires_gradient_sync(
False)`` on all but the last micro-batch; a unit that reduce-scatters twice before
``step`` restarts the row as above.
"""

import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from gradstat.capture import fsdp
from gradstat.capture.budget import API_SUGGESTION, CapturePlan, budget_problem, free_bytes
from gradstat.capture.budget import recorded_rows as count_rows
from gradstat.capture.fsdp_row import UnitArrivals
from gradstat.capture.hook_setup import (
    capture_metadata,
    capture_units,
    check_layouts,
    check_no_comm_hook,
    check_settings,
    select_parameters,
    shared_run_id,
)
from gradstat.capture.writer_thread import BackgroundWriter, PendingRow, compression_meta
from gradstat.compressors.plan import ddp_bucket_caps
from gradstat.errors import GradstatWarning
from gradstat.hooks import fsdp_compression
from gradstat.store.dtypes import torch_dtype
from gradstat.store.ranks import parse_ranks
from gradstat.store.schema import rank_file_name
from gradstat.store.writer import finalize_root, write_root

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def ddp_bucket_meta(model: Any) -> dict[str, int]:
    """The DDP model's bucket caps for the capture's metadata (docs/format.md)."""
    caps = ddp_bucket_caps(model)
    if caps is None:
        return {}
    return {"ddp_bucket_cap_bytes": caps[0], "ddp_first_bucket_bytes": caps[1]}


def _capture_hook(
    capture: "GradientCapture", bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Record the bucket (on recorded steps), then run the wrapped hook.

    Annotations are real objects (no postponed evaluation in this module): DDP checks
    that a hook's bucket argument is annotated ``dist.GradBucket``.
    """
    if capture.recording:
        capture._record_bucket(bucket)
    return capture.hook(capture._inner_state(), bucket)


class GradientCapture:
    """Record each learner's local gradient to ``out_dir/rank-NNNNN.h5`` during training.

    Args:
        model: the DistributedDataParallel model (the hook is registered on it), or a
            model with ``fully_shard`` applied (FSDP2: every unit's reduce-scatter is
            wrapped, see gradstat/capture/fsdp.py; ``hook`` does not apply).
        out_dir: the capture folder; rank 0 also writes ``capture.h5`` there.
        every: record every ``every``-th step, starting at ``start``.
        layers: regex of parameter names to record (default: all trainable ones).
        dtype: ``float32``, ``float16`` or ``bfloat16`` on disk (docs/format.md);
            default ``float32``, or under FSDP2 the dtype every unit reduces in when
            that is ``bfloat16`` or ``float16`` (the values are in it already).
        record_ranks: the learners that record, e.g. ``[0, 3]`` or ``"0-7"`` or
            ``"::8"`` (gradstat/store/ranks.py); default all.
        compression: ``none``, ``gzip``, ``lzf``, ``lz4`` or ``zstd`` (docs/format.md).
        total_steps, max_bytes: with ``total_steps`` (the optimizer steps training will
            run), rank 0 warns before training when the capture would not fit on the disk
            or would exceed ``max_bytes``.
        hook, hook_state: the communication hook to wrap and its state
            (default: plain all-reduce), e.g. PyTorch's ``fp16_compress_hook`` or
            ``powerSGD_hook`` with a ``PowerSGDState``, or gradstat's own
            ``gradstat.hooks.compression_hook``: then each learner's contribution after
            compression is recorded too, as the ``sent`` dataset (docs/online.md).
        meta: extra attributes for ``capture.h5`` (workload, command line, ...).
        batch_size: each learner's batch per optimizer step (micro-batch times
            accumulation steps), recorded for ``gradstat noise`` (docs/noise.md).
        max_queue: rows that may wait for the writer before training blocks.
    """

    def __init__(
        self,
        model: DistributedDataParallel | torch.nn.Module,
        out_dir: str | Path,
        *,
        every: int = 1,
        start: int = 0,
        layers: str | None = None,
        dtype: str | None = None,
        hook: CommHook | None = None,
        hook_state: Any = None,
        meta: Mapping[str, Any] | None = None,
        max_queue: int = 4,
        process_group: dist.ProcessGroup | None = None,
        record_ranks: str | Sequence[int] | None = None,
        compression: str = "none",
        total_steps: int | None = None,
        max_bytes: int | None = None,
        batch_size: int | None = None,
    ) -> None:
        check_settings(every, start, dtype, compression, batch_size)
        self.every, self.start = every, start
        self.hook, self.hook_state = hook or allreduce_hook, hook_state
        self.process_group, self.out_dir = process_group, Path(out_dir)
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.recorded_ranks = parse_ranks(record_ranks, self.world_size)
        self._units = capture_units(model, hook, hook_state)
        dtype = self._lay_out(model, layers, dtype)
        self._reset_state()
        # a gradstat compression hook: bind it to the model, record what it sent
        self._records_sent = hasattr(hook_state, "bind_for_capture")
        meta = self._training_meta(model, layers, hook_state, meta)
        # hook first, files after: a model that cannot take the hook leaves nothing behind
        records = self.rank in self.recorded_ranks
        self._register(model, records)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        device = self._device if self._device.type == "cuda" else None
        run_id = shared_run_id(self.rank, self.process_group, device)
        if self.rank == 0:
            if total_steps is not None:
                self._warn_over_budget(total_steps, dtype, max_bytes)
            settings = (every, start, layers, compression, batch_size)
            self._write_root({**self._units_meta, **(meta or {})}, settings, dtype, run_id)
        self.writer = self._start_writer(dtype, max_queue, compression, run_id) if records else None

    def _write_root(
        self, meta: Mapping[str, Any] | None, settings: tuple, dtype: str, run_id: str
    ) -> None:
        """Rank 0's ``capture.h5``: the layer table and the metadata of ``settings``
        (every, start, layers, compression, batch_size) and ``meta``."""
        metadata = capture_metadata(self._kind, self.process_group, meta, *settings)
        ranks = self.recorded_ranks
        write_root(self.out_dir, self.layers, self.world_size, dtype, metadata, ranks, run_id)

    def _training_meta(self, model: Any, layers: str | None, state: Any, meta: Any) -> dict:
        """``meta`` with how training communicated: DDP's bucket caps (a replay cuts its
        steps as DDP did) and a gradstat compression hook's compressor and plan (bound to
        the model here: it records what the hook sent)."""
        meta = {**(ddp_bucket_meta(model) if not self._units else {}), **(meta or {})}
        if self._records_sent and self._units:  # inside each unit's reduce-scatter
            state.bind_for_fsdp(model, layers, self._units_meta["fsdp_units"])
            meta = {**meta, **compression_meta(state), **state.plan_meta()}
        elif self._records_sent:
            state.bind_for_capture(model, layers)
            meta = {**meta, **compression_meta(state), **state.plan_meta()}
        return meta

    def _start_writer(
        self, dtype: str, max_queue: int, compression: str, run_id: str
    ) -> BackgroundWriter:
        """This rank's writer thread and rank file (``max_queue`` rows may wait for it)."""
        path = self.out_dir / rank_file_name(self.rank)
        return BackgroundWriter(
            path,
            self.rank,
            self.numel,
            dtype,
            self._release,
            max_queue,
            compression,
            sent=self._records_sent,
            run_id=run_id,
        )

    def _lay_out(self, model: torch.nn.Module, layers: str | None, dtype: str | None) -> str:
        """Where each recorded parameter goes in the flat row (``_slots``, and for FSDP
        each unit's ``_layouts``), the row's length, device and storage dtype (returned:
        ``dtype``, or the default for this model), and what ``capture.h5`` says of the
        data parallelism (``_kind``, ``_units_meta``)."""
        self.layers, params = select_parameters(model, layers)
        self.numel = self.layers[-1].stop
        self._slots = {
            param: (layer.offset, layer.numel)
            for param, layer in zip(params, self.layers, strict=True)
        }
        offsets = {id(p): offset for p, (offset, _) in self._slots.items()}
        self._layouts = fsdp.unit_layouts(model, offsets) if self._units else []
        replicate = getattr(self.hook_state, "replicate", 1)
        if self._layouts and replicate > 1:  # gradstat runs HSDP's replicate stage
            fsdp_compression.mark_replicated(self._layouts, replicate)
        self._arrivals = UnitArrivals([layout for _, layout in self._layouts], self.rank)
        layer_of = {id(p): i for i, p in enumerate(params)}
        units = fsdp.units_meta(self._arrivals.layouts, layer_of)  # FSDP's messages
        self._units_meta = {"fsdp_units": units} if self._units else {}
        self._kind = "fsdp2" if self._units else "ddp"
        self._device = params[0].device
        if dtype is None:
            dtype = fsdp.storage_dtype(self._arrivals.layouts) if self._units else "float32"
        self._storage_dtype = torch_dtype(dtype)
        return dtype

    def _reset_state(self) -> None:
        """The state of a capture before its first step: no row, no buffer, no warning,
        no writer."""
        self.writer: BackgroundWriter | None = None
        self._pool: list[torch.Tensor] = []
        self._pool_lock = threading.Lock()
        self._iteration = 0
        self._pending: torch.Tensor | None = None
        self._copied = 0
        self._buckets_seen: set[int] = set()
        self._unit_events: list[torch.cuda.Event] = []
        self._warned_second_backward = False
        self._closed = False

    def _register(self, model: torch.nn.Module, records: bool) -> None:
        """Wrap the model's communication (DDP's hook, or each FSDP unit's reduce-scatter);
        a learner that does not record gets the wrapped hook alone, as without gradstat."""
        if self._units:
            check_layouts(self._layouts)
            if self._records_sent:  # the compressor replaces FSDP's reduce-scatter
                fsdp_compression.install(self.hook_state, self._layouts)
            if records:
                self._install_fsdp()
        else:
            check_no_comm_hook(model)
            if records:
                model.register_comm_hook(self, _capture_hook)
            else:
                model.register_comm_hook(self._inner_state(), self.hook)

    def _install_fsdp(self) -> None:
        for unit, layout in self._layouts:
            fsdp.install(
                unit,
                lambda flat, world, layout=layout: self._record_unit(layout, flat, world),
                layout.shard,
            )

    def _inner_state(self) -> Any:
        """The wrapped hook's state (PyTorch's all-reduce hook takes the process group)."""
        if self.hook is allreduce_hook and self.hook_state is None:
            return self.process_group
        return self.hook_state

    def _warn_over_budget(self, total_steps: int, dtype: str, max_bytes: int | None) -> None:
        plan = CapturePlan(
            rows=count_rows(total_steps, self.every, self.start),
            learners=len(self.recorded_ranks),
            numel=self.numel,
            dtype=dtype,
            layers=len(self.layers),
            sent=self._records_sent,
        )
        problem = budget_problem(plan, free_bytes(self.out_dir), max_bytes, API_SUGGESTION)
        if problem is not None:
            warnings.warn(f"gradstat: {problem}", GradstatWarning, stacklevel=3)

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
    def records(self) -> bool:
        """Whether this rank writes a rank file (it is one of ``record_ranks``)."""
        return self.writer is not None

    @property
    def failed(self) -> bool:
        """Whether this rank's writer stopped on an error."""
        return self.writer is not None and self.writer.failed

    @property
    def bytes_written(self) -> int:
        """Gradient bytes this rank has written so far (0 on ranks that do not record)."""
        return 0 if self.writer is None else self.writer.bytes_written

    @property
    def rows_written(self) -> int:
        """Rows this rank has written so far (0 on ranks that do not record)."""
        return 0 if self.writer is None else self.writer.rows_written

    @property
    def recording(self) -> bool:
        """Whether the current iteration is one that gets recorded."""
        it = self._iteration
        return (
            self.writer is not None
            and not self._closed
            and not self.writer.failed
            and it >= self.start
            and (it - self.start) % self.every == 0
        )

    def _record_bucket(self, bucket: dist.GradBucket) -> None:
        if self._pending is None:
            self._pending = self._acquire()
            self._copied = 0
        elif bucket.index() in self._buckets_seen:  # a new backward: restart the row
            self._warn_second_backward()
            self._copied = 0
            self._buckets_seen.clear()
        self._buckets_seen.add(bucket.index())
        non_blocking = self._device.type == "cuda"
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            slot = self._slots.get(param)
            if slot is not None:
                offset, numel = slot
                self._pending[offset : offset + numel].copy_(
                    grad.reshape(-1), non_blocking=non_blocking
                )
                self._copied += numel

    def _record_unit(self, layout: fsdp.UnitLayout, flat: torch.Tensor, world: int) -> None:
        """An FSDP unit's reduce-scatter input (1-D, ``world`` chunks): into the row."""
        if not self.recording:
            return
        if self._pending is None:
            self._pending = self._acquire()
            self._arrivals.clear()
        elif self._arrivals.seen(layout):  # a new backward: restart the row
            self._warn_second_backward()
            self._arrivals.clear()
            self._unit_events.clear()
        cuda = self._device.type == "cuda"
        whole = layout.copy_into(self._pending, flat, world, non_blocking=cuda)
        self._arrivals.arrived(layout, whole)
        if cuda and whole:  # the copies run on FSDP's reduce-scatter stream
            event = torch.cuda.Event()
            event.record()
            self._unit_events.append(event)

    def _warn_second_backward(self) -> None:
        if self._warned_second_backward:
            return
        self._warned_second_backward = True
        how = (
            "run all but the last backward after model.set_requires_gradient_sync(False) "
            "(without it FSDP reduce-scatters every micro-batch)"
            if self._units
            else "run all but the last backward inside ddp.no_sync() (without it DDP "
            "all-reduces every micro-batch)"
        )
        warnings.warn(
            f"gradstat (rank {self.rank}): a second backward pass before capture.step(). "
            f"For gradient accumulation, {how}; if you skipped an optimizer step, still "
            "call capture.step() once per step. The row now holds the last backward's "
            "gradients.",
            GradstatWarning,
            stacklevel=4,
        )

    def step(self, step: int | None = None, loss: float | None = None) -> None:
        """Finish the current optimizer step: hand a recorded row to the writer."""
        if self._records_sent and self._units:  # the compressor's step under FSDP2
            self.hook_state.end_step()
        if self._pending is None and self._units and self.recording:
            self._arrivals.finish_empty(self._iteration if step is None else int(step))
        if self._pending is not None:
            ready = None
            if self._device.type == "cuda":
                stream = torch.cuda.current_stream()
                for event in self._unit_events:  # FSDP's copies, on its own streams
                    stream.wait_event(event)
                ready = torch.cuda.Event()
                ready.record()
            row_step = self._iteration if step is None else int(step)
            row_loss = float("nan") if loss is None else float(loss)
            if self._units:  # FSDP: units that did not arrive become zeros, with a warning
                complete = self._arrivals.finish(self._pending, row_step)
            else:
                complete = self._copied == self.numel
            if complete and self.writer is not None:
                row = PendingRow(row_step, row_loss, self._pending, ready)
                if self._records_sent:
                    row.sent, row.sent_bytes = self._sent_row()
                self.writer.submit(row)
            else:  # a step without a (complete) backward: nothing consistent to record
                self._release(self._pending)
            self._pending = None
            self._buckets_seen.clear()
            self._unit_events.clear()
        self._iteration += 1

    def _sent_row(self) -> tuple[torch.Tensor, float]:
        """The compression hook's contribution of this step, in the capture's dtype."""
        sent = self._acquire()
        sent.copy_(self.hook_state.sent)
        return sent, float(self.hook_state.payload_bytes)

    def flush(self) -> None:
        """Wait until every recorded row handed to the writer is in the rank file."""
        if self.writer is not None:
            self.writer.drain()

    def close(self) -> None:
        """Flush the writer; rank 0 marks the capture complete once every rank is done.

        Collective: call it on every rank.
        """
        if self._closed:
            return
        self._closed = True
        self._arrivals.close()
        if self.writer is not None:
            self.writer.close()
        failed = torch.tensor([float(self.failed)], device=self._device)
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
            if self.writer is not None:
                self.writer.close()
