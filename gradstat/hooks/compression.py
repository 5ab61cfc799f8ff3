"""Every registry compressor with an online form as a DDP communication hook.

``compression_hook(name, ratio=..., **params)`` returns ``(hook, state)`` for
``ddp.register_comm_hook(state, hook)``. The compressor and its error-feedback memory are
the replay's own (:func:`gradstat.compressors.registry.build_scheme`; this learner's
compressor object is ``Scheme.for_learner(rank)``), and one step is the compressor's
``online`` form with a :class:`~gradstat.compressors.communicator.TorchCommunicator`, so
online and offline run the same compressor code.

**Whole-model compression, as the replay.** DDP calls a hook once per gradient bucket,
while the replay compresses the flat model vector (scope ``model``: every trainable
parameter in ``named_parameters`` order, the capture's layer table). The hook therefore
collects the buckets of a step: each bucket's gradients are copied into one flat vector
at their parameters' offsets and the bucket gets a future that is not yet complete. When
the last bucket of the step arrives (every element collected), the state compensates
with its memory, runs the exchange once on the whole vector, updates its memory and
completes every pending future with its slice of the aggregate. DDP waits on the
futures only once the backward pass is over, so nothing blocks. The price is that no
communication overlaps the backward pass (as with any whole-model compressor).

The state keeps, for recording (``GradientCapture`` writes it as the ``sent`` dataset)
and for checks: ``sent`` (this learner's contribution of the last step, flat, fp32,
``m_{t+1} = p_t - sent_t`` for plain error feedback), ``estimate`` (the aggregate every
learner applied), ``transfers`` (the bytes it put into each collective) and
``overhead_bytes``. The hooks compute on the CPU and need a gloo process group for
their collectives (``process_group=``): the replay compressors are CPU code.
"""

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from gradstat.compressors.base import Compressor
from gradstat.compressors.communicator import TorchCommunicator
from gradstat.compressors.exchange import Transfer
from gradstat.compressors.memory import TensorRows
from gradstat.compressors.registry import CompressorSpec, Scheme, build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.errors import UsageError
from gradstat.stats.density import k_for

#: Registry compressors that have no online form (none: every one has).
OFFLINE_ONLY: frozenset[str] = frozenset()


class CompressionState:
    """The state of a compression hook: the scheme, its memory and the last step's
    outcome (see the module docstring). Bind it to the model's parameters before the
    first backward pass (``compression_hook(..., model=ddp)`` or ``GradientCapture``
    does it)."""

    def __init__(
        self,
        name: str | CompressorSpec,
        ratio: float | None,
        params: Mapping[str, float],
        *,
        process_group: dist.ProcessGroup | None = None,
        seed: int = 0,
    ) -> None:
        spec = name if isinstance(name, CompressorSpec) else parse_compressors(name)[0]
        unknown = sorted(set(params) - set(spec.entry.params))
        if unknown:
            known = ", ".join(spec.entry.params) or "none"
            raise UsageError(f"{name} has no parameter {unknown[0]!r} (known: {known})")
        if params:
            assignments = ":".join(f"{k}={float(v):g}" for k, v in params.items())
            spec = parse_compressors(f"{spec.name}:{assignments}")[0]
        if not spec.fixed_rate and ratio is None:
            raise UsageError(f"{name} is a sparsifier: give it a ratio")
        self.spec = spec
        self.ratio = None if spec.fixed_rate else ratio
        self.process_group = process_group
        self.seed = seed
        self.scheme: Scheme | None = None
        self.compressor: Compressor | None = None
        self.numel = 0
        self._slots: dict[Any, tuple[int, int]] = {}
        self._flat: torch.Tensor | None = None
        self._collected = 0
        self._pending: list[tuple[dist.GradBucket, torch.futures.Future]] = []
        self.steps = 0
        self.sent: torch.Tensor | None = None
        self.estimate: torch.Tensor | None = None
        self.transfers: tuple[Transfer, ...] = ()
        self.overhead_bytes = 0
        self.selected = 0

    @property
    def label(self) -> str:
        return self.spec.label

    def settings(self) -> dict[str, float]:
        """The compressor's settings (as ``recommend`` reports them) and its ratio."""
        settings = {}
        if self.scheme is not None and self.compressor is not None:
            settings = {**dict(self.spec.params), **self.compressor.settings()}
        if self.ratio is not None:
            settings["ratio"] = self.ratio
        return settings

    @property
    def payload_bytes(self) -> float:
        """Bytes this learner put into the last step's collectives."""
        return sum(t.nbytes for t in self.transfers)

    def bind(self, parameters: list[torch.nn.Parameter] | Any) -> None:
        """Lay the trainable ``parameters`` end to end (in this order) and build the
        compressor for that flat vector, as the replay does for scope ``model``."""
        params = [p for p in parameters if p.requires_grad]
        if not params:
            raise UsageError("the model has no trainable parameter to compress")
        offset, shapes = 0, []
        self._slots = {}
        for param in params:
            self._slots[param] = (offset, param.numel())
            shapes.append(tuple(param.shape))
            offset += param.numel()
        self.numel = offset
        k = None if self.ratio is None else k_for(self.ratio, self.numel)
        self.scheme = build_scheme(
            self.spec, self.ratio, k, numel=self.numel, shapes=shapes, seed=self.seed
        )
        rank = dist.get_rank(self.process_group) if dist.is_initialized() else 0
        self.compressor = self.scheme.for_learner(rank)
        self.scheme.memory.allocate(1, self.numel, TensorRows)
        self._flat = torch.zeros(self.numel)

    def bind_for_capture(self, module: torch.nn.Module, layers: str | None) -> None:
        """Bind to the captured model; the capture must record every parameter, so that
        its ``grad`` and ``sent`` rows are the vectors the hook compressed."""
        if layers:
            raise UsageError(
                "a compression hook compresses the whole model: record every layer "
                "(no layers regex) so that grad and sent rows are the compressed vector"
            )
        if self.scheme is None:
            self.bind(list(module.parameters()))

    # --- the hook's work ------------------------------------------------------------
    def collect(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Copy a bucket into the flat vector; its future completes with the step."""
        if self.scheme is None or self._flat is None:
            raise UsageError(
                "bind the compression hook's state to the model first: "
                "compression_hook(..., model=ddp) or GradientCapture(hook=..., hook_state=...)"
            )
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            slot = self._slots.get(param)
            if slot is None:
                raise UsageError("the hook's state was bound to other parameters than DDP's")
            offset, numel = slot
            self._flat[offset : offset + numel].copy_(grad.detach().reshape(-1))
            self._collected += numel
        future: torch.futures.Future = torch.futures.Future()
        self._pending.append((bucket, future))
        if self._collected >= self.numel:
            self._finish_step()
        return future

    def _finish_step(self) -> None:
        assert self.scheme is not None and self._flat is not None and self.compressor
        memory = self.scheme.memory
        corrected, state = memory.compensate(0, self._flat)
        comm = TorchCommunicator(self.process_group)
        outcome = self.compressor.online(corrected, "model", comm)
        memory.update(0, corrected, outcome.sent, state)
        memory.norm()  # the step's norm is not recorded online
        self.sent, self.estimate = outcome.sent, outcome.estimate
        self.transfers, self.overhead_bytes = outcome.transfers, outcome.overhead_bytes
        self.selected = outcome.selected
        self.steps += 1
        pending, self._pending, self._collected = self._pending, [], 0
        for bucket, future in pending:
            buffer = bucket.buffer()
            result = torch.empty_like(buffer)
            position = 0
            for param in bucket.parameters():
                offset, numel = self._slots[param]
                result[position : position + numel].copy_(outcome.estimate[offset : offset + numel])
                position += numel
            future.set_result(result)


def _compression_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: collect the bucket, compress once per step.

    Annotations are real objects (no postponed evaluation in this module): DDP checks
    that a hook's bucket argument is annotated ``dist.GradBucket``.
    """
    return state.collect(bucket)


def compression_hook(
    name: str,
    ratio: float | None = None,
    *,
    model: torch.nn.Module | None = None,
    process_group: dist.ProcessGroup | None = None,
    seed: int = 0,
    **params: float,
):
    """``(hook, state)`` of registry compressor ``name`` for ``register_comm_hook``.

    ``ratio`` is the density k/d of sparsifiers (ignored by fixed-rate compressors);
    ``params`` are the registry parameters (``beta=`` for CLT-k, ``rank=`` for PowerSGD,
    ``momentum=`` for DGC, ``levels=``/``bucket=`` for QSGD, ``stages=`` for SIDCo,
    ``threshold=``). ``model`` (the DDP model or its module) binds the state now;
    ``GradientCapture`` binds it otherwise. ``seed`` seeds random-k's shared draw, DGC's
    sampling, QSGD and TernGrad (each learner draws its own stream for the last three).

    Example::

        hook, state = compression_hook("topk", ratio=0.01, model=ddp)
        ddp.register_comm_hook(state, hook)
    """
    if ratio is not None and not (0.0 < ratio < 1.0 and math.isfinite(ratio)):
        raise UsageError(f"ratio {ratio} is outside (0, 1)")
    state = CompressionState(name, ratio, params, process_group=process_group, seed=seed)
    if model is not None:
        module = getattr(model, "module", model)
        state.bind(list(module.parameters()))
    return _compression_hook, state
