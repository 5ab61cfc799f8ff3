"""Every compressor as a DDP communication hook, message by message as buckets arrive.

``compression_hook(name, ratio=..., granularity="bucket", **params)`` returns ``(hook,
state)`` for ``ddp.register_comm_hook(state, hook)``. The compressor, its memory and the
communication plan are the replay's own (:func:`gradstat.compressors.registry.
build_scheme` over :func:`gradstat.compressors.plan.build_plan` of the model's trainable
parameters), and one message is its compressor's exchange driven by a
:class:`~gradstat.compressors.communicator.TorchCommunicator`: online and offline run the
same compressor code on the same messages.

**Per bucket, overlapping the backward pass.** DDP calls the hook once per gradient
bucket as its gradients become ready. The hook copies the bucket's gradients into the
flat row and hands every message of the plan whose parameters have all arrived to a
worker thread, which compensates it with its memory, runs its exchange, updates the
memory and writes the aggregate; the backward pass goes on meanwhile. A bucket's future
completes once the messages holding its parameters are done. At ``bucket`` granularity
(DDP's rule, the default) a message is its bucket: it is exchanged as soon as DDP hands
it over, as PyTorch's own hooks do (DDP's first iteration hands every parameter in one
bucket: the messages then go once it arrives). At ``model`` granularity the one message
goes with the last bucket; at ``tensor`` each parameter as its bucket arrives. One
worker runs the messages in the plan's order of completion, which is the same on every
learner, so their collectives meet.

The state keeps, for recording (``GradientCapture`` writes it as the ``sent`` dataset)
and for checks: ``sent`` (this learner's contribution of the last step, flat, fp32, in
the layer table's order; ``m_{t+1} = p_t - sent_t`` for plain error feedback),
``estimate`` (the aggregate every learner applied; under HSDP its shard group's, which
the replicate stage then averages: FSDP's dense all-reduce, or with ``replicate=R``
:meth:`CompressionState.run_replicate` in each unit's all-reduce hook), ``transfers``
(the bytes it put into each collective, both stages') and ``overhead_bytes``. Steps
are numbered from 0 (``state.step``), as the replay numbers the recorded steps of a
capture that starts at 0: random draws and CLT-k's leader follow it. The hooks compute
on the CPU (the compressors are CPU code) and run their collectives on a gloo process
group: ``process_group=``, else one of their own made when the state is bound (so they
never meet DDP's own collectives).
"""

import json
import math
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from gradstat.compressors.communicator import TorchCommunicator
from gradstat.compressors.exchange import SparseRow, Transfer
from gradstat.compressors.memory import TensorRows
from gradstat.compressors.plan import MIB, Plan, build_plan, ddp_bucket_caps, unit_members
from gradstat.compressors.registry import CompressorSpec, Scheme, build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.errors import UsageError
from gradstat.store.schema import layer_table


def _put(row: torch.Tensor, slices, vector: torch.Tensor | SparseRow) -> None:
    """A message's flat ``vector`` into ``row`` at its ``slices``."""
    flat = vector.dense() if isinstance(vector, SparseRow) else vector.reshape(-1)
    position = 0
    for offset, numel in slices:
        row[offset : offset + numel] = flat[position : position + numel]
        position += numel


class CompressionState:
    """The state of a compression hook (see the module docstring). Bind it to the model's
    parameters before the first backward pass (``compression_hook(..., model=ddp)`` or
    ``GradientCapture`` does it)."""

    def __init__(
        self,
        name: str | CompressorSpec,
        ratio: float | None,
        params: Mapping[str, float],
        *,
        process_group: dist.ProcessGroup | None = None,
        seed: int = 0,
        granularity: str = "bucket",
        dense: str | None = None,
        dense_below: int = 0,
        replicate: int = 1,
    ) -> None:
        if (granularity != "unit" and replicate != 1) or replicate < 1:
            raise UsageError(
                f"replicate={replicate}: HSDP's replicate stage is compressed inside FSDP2 "
                "units (granularity unit, replicate >= 1)"
            )
        self.replicate = replicate
        spec = name if isinstance(name, CompressorSpec) else parse_compressors(name)[0]
        unknown = sorted(set(params) - set(spec.entry.params))
        if unknown:
            known = ", ".join(spec.entry.params) or "none"
            raise UsageError(f"{name} has no parameter {unknown[0]!r} (known: {known})")
        if params:
            assignments = ":".join(f"{k}={float(v):g}" for k, v in params.items())
            spec = parse_compressors(f"{spec.base_label}:{assignments}")[0]
        if not spec.fixed_rate and ratio is None:
            raise UsageError(f"{name} is a sparsifier: give it a ratio")
        self.spec = spec
        self.ratio = None if spec.fixed_rate else ratio
        self.process_group = process_group
        self.seed = seed
        self.plan_options: dict[str, Any] = {
            "granularity": granularity,
            "dense": dense,
            "dense_below": dense_below,
        }
        if replicate > 1:  # a replay of this run on a dense run's capture runs it too
            self.plan_options["replicate_compressed"] = True
            if dense or dense_below:
                raise UsageError(
                    "dense= and dense_below= are not supported with a compressed HSDP "
                    "replicate stage (each shard holds every parameter of its unit)"
                )
        check = layer_table([("check", (1,))])  # the options, checked before training
        units = [("check", ["check"], 1, False)] if granularity == "unit" else None
        build_plan(check, granularity, dense=dense, dense_below=dense_below, units=units)
        self.scheme: Scheme | None = None
        self.plan: Plan | None = None
        self.step = 0
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
        if self.scheme is not None:
            settings = self.scheme.settings()
        if self.ratio is not None:
            settings["ratio"] = self.ratio
        return settings

    @property
    def payload_bytes(self) -> float:
        """Bytes this learner put into the last step's collectives."""
        return sum(t.nbytes for t in self.transfers)

    def bind(self, model: torch.nn.Module, units: str | None = None) -> None:
        """Lay the trainable parameters of ``model`` (a DDP model or its module, or an
        FSDP2 model) end to end (``named_parameters`` order, the capture's layer table)
        and build the plan (``bucket`` with a DDP model's caps; ``unit`` with the
        capture's ``fsdp_units`` JSON, ``units``) and the compressor on them."""
        module = getattr(model, "module", model)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise UsageError("the model has no trainable parameter to compress")
        layers = layer_table([(n, tuple(p.shape)) for n, p in named])
        options = dict(self.plan_options)
        caps = ddp_bucket_caps(model)
        if options["granularity"] == "bucket" and caps is not None:
            options["granularity"] = f"bucket:{caps[0] / MIB:g}"
            options["first_bucket_bytes"] = caps[1]
        self.plan_options = options
        members = unit_members(units, layers) if options["granularity"] == "unit" else None
        self.plan = build_plan(layers, **options, units=members)
        self.scheme = build_scheme(self.spec, self.ratio, self.plan, seed=self.seed)
        self.scheme.memory.allocate(1, self.plan, TensorRows)
        if self.process_group is None and dist.is_initialized():
            # a gloo group of its own (made on every rank, as binding is): the worker's
            # collectives never meet DDP's own (find_unused_parameters' all-reduce)
            self.process_group = dist.new_group(backend="gloo")
        self.rank = dist.get_rank(self.process_group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
        self._slots = {
            p: (layer.offset, layer.numel) for (_, p), layer in zip(named, layers, strict=True)
        }
        holder = {}
        for m, message in enumerate(self.plan.messages):
            for offset, _ in message.slices:
                holder[offset] = m
        self._message_of = {p: holder[offset] for p, (offset, _) in self._slots.items()}
        self._needs = [len(m.slices) for m in self.plan.messages]
        numel = layers[-1].stop
        self._flat, self.sent, self.estimate = (torch.zeros(numel) for _ in range(3))
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="gradstat-compress")
        self._start_step()

    def bind_for_capture(self, model: Any, layers: str | None) -> None:
        """Bind to the captured model (the DDP model: its bucket caps become the plan's);
        the capture must record every parameter, so that its ``grad`` and ``sent`` rows
        are the vectors the hook compressed."""
        if layers:
            raise UsageError(
                "a compression hook compresses every parameter: record every layer "
                "(no layers regex) so that grad and sent rows are the vectors it compressed"
            )
        if self.scheme is None:
            self.bind(model)

    def bind_for_fsdp(self, model: Any, layers: str | None, units: str) -> None:
        """Bind to a captured FSDP2 model: the ``unit`` plan of its units (``units``: the
        capture's ``fsdp_units`` JSON); every parameter recorded, as for DDP."""
        if self.plan_options["granularity"] == "bucket":  # the hook's default: DDP's
            self.plan_options = {**self.plan_options, "granularity": "unit"}
        if self.plan_options["granularity"] != "unit":
            raise UsageError(
                f"a compressor under FSDP2 runs inside each unit's reduce-scatter: "
                f"granularity unit, not {self.plan_options['granularity']}"
            )
        if layers:
            self.bind_for_capture(model, layers)  # the error
        if self.scheme is None:
            self.bind(model, units)

    def run_unit(
        self,
        layout: Any,
        messages: list[int],
        flat: torch.Tensor,
        world: int,
        group: dist.ProcessGroup | None = None,
    ) -> torch.Tensor:
        """An FSDP unit's reduce-scatter input ``flat`` (float32, 1-D) into the flat row,
        then its ``messages`` exchanged now (on the calling thread) over ``group`` (HSDP:
        a gloo group of the learner's shard group; None: the hook's group of every
        learner); the estimate row (the mean of ``group``'s learners, in the layer
        table's order; under HSDP the replicate stage averages it next)."""
        learners = self.world if group is None else dist.get_world_size(group)
        if world != learners:
            raise UsageError(
                f"FSDP unit {layout.name} reduce-scatters over {world} learners, the "
                f"compression hook's group has {learners}"
            )
        if not layout.copy_into(self._flat, flat, world, non_blocking=False):
            raise UsageError(
                f"FSDP unit {layout.name} reduce-scattered only some of its parameters at "
                f"step {self.step} (the others got no gradient): a compressor needs them "
                "all; model.set_reduce_scatter_unused_params(True) sends zeros for them"
            )
        for m in messages:
            self._run(m, group)
        return self.estimate

    def end_step(self) -> None:
        """Close an FSDP step (``GradientCapture.step``): the transfers of the messages
        that ran; messages of units that did not reduce-scatter sent and applied
        nothing (zeros)."""
        with self._lock:
            for m, message in enumerate(self.plan.messages):
                if not self._done[m]:
                    _put(self.sent, message.slices, torch.zeros(message.numel))
                    _put(self.estimate, message.slices, torch.zeros(message.numel))
            ordered = [self._results[j] for j in sorted(self._results)]
            self.transfers = tuple(t for r in ordered for t in r[2])
            self.selected = sum(r[3] for r in ordered)
            self.overhead_bytes = sum(r[4] for r in ordered)
            self.step += 1
            self._start_step()

    def plan_meta(self) -> dict[str, str]:
        """The capture's record of the plan (``compressor_plan``: how to replay the run)."""
        return {"compressor_plan": json.dumps(self.plan_options)}

    def _start_step(self) -> None:
        self._arrived = [0] * len(self.plan.messages)
        self._done = [False] * len(self.plan.messages)
        self._pending: list[tuple[Any, torch.futures.Future, set[int]]] = []
        self._results: dict[int, Any] = {}

    # --- the hook's work ------------------------------------------------------------
    def collect(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Copy a bucket into the flat row; start the messages it completes. Its future
        completes once the messages holding its parameters are done."""
        if self.scheme is None:
            raise UsageError(
                "bind the compression hook's state to the model first: "
                "compression_hook(..., model=ddp) or GradientCapture(hook=..., hook_state=...)"
            )
        future: torch.futures.Future = torch.futures.Future()
        needs: set[int] = set()
        ready = []
        with self._lock:
            for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
                slot = self._slots.get(param)
                if slot is None:
                    raise UsageError("the hook's state was bound to other parameters than DDP's")
                offset, numel = slot
                self._flat[offset : offset + numel].copy_(grad.detach().reshape(-1))
                m = self._message_of[param]
                needs.add(m)
                self._arrived[m] += 1
                if self._arrived[m] == self._needs[m]:
                    ready.append(m)
            self._pending.append((bucket, future, needs))
        for m in sorted(ready):
            self._worker.submit(self._exchange, m)
        return future

    def _exchange(self, m: int) -> None:
        """Message ``m`` of this step, on the worker thread (see the module docstring)."""
        try:
            self._run(m)
        except BaseException as exc:  # every bucket waiting on it fails with it
            with self._lock:
                pending, self._pending = self._pending, []
            for _, future, _ in pending:
                future.set_exception(exc)
            raise
        self._finish_buckets(m)

    def _run(self, m: int, group: dist.ProcessGroup | None = None) -> None:
        """Message ``m`` exchanged over ``group`` (None: the hook's own, every learner;
        the compressor objects stay this learner's, the call numbers it in ``group``)."""
        scheme, plan = self.scheme, self.plan
        message = plan.messages[m]
        learner, learners = self.rank, self.world
        if group is None:
            group = self.process_group
        else:
            learner, learners = dist.get_rank(group), dist.get_world_size(group)
        g = torch.cat([self._flat[o : o + k] for o, k in message.slices])
        if message.dense:  # sent as it is: a float32 all-reduce, averaged
            total = g.clone()
            dist.all_reduce(total, group=group)
            sent, estimate = g, total / learners
            result = (sent, estimate, (Transfer("allreduce", 4 * g.numel()),), g.numel(), 0)
        else:
            outcome = self._compressed(scheme, m, g, learner, learners, group, self.rank)
            result = (
                outcome.contribution(),
                outcome.estimate,
                outcome.transfers,
                outcome.selected,
                outcome.overhead_bytes,
            )
        _put(self.sent, message.slices, result[0])
        _put(self.estimate, message.slices, result[1])
        with self._lock:
            self._results[m] = result
            self._done[m] = True

    def _compressed(
        self,
        scheme: Scheme,
        m: int,
        g: torch.Tensor,
        learner: int,
        learners: int,
        group: dist.ProcessGroup,
        who: int,
    ) -> Any:
        """Message ``m`` of ``scheme`` compensated, exchanged over ``group`` (``learner``
        of ``learners`` there), its memory updated; ``who``: the learner whose compressor
        object runs it. The exchange's outcome."""
        memory = scheme.memory
        block = memory.places[m][0]
        rows = memory.open(0, block)
        call = scheme.call(learner, m, self.step, learners)
        p = memory.compensate(rows, call, g)
        compressor = scheme.compressor(who, m)
        outcome = TorchCommunicator(group).run(compressor.exchange(p.view(call.shape), call))
        memory.update(rows, call, p, outcome, compressor)
        memory.close(0, block, rows)
        return outcome

    def run_replicate(
        self, m: int, shard: torch.Tensor, shards: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        """HSDP's compressed replicate stage of message ``m`` on this learner: ``shard``
        (float32, 1-D), its shard of its shard group's mean (``shards`` learners a group),
        exchanged over ``group``, the R learners holding the same shard index
        (:meth:`~gradstat.compressors.registry.Scheme.replicate_stage`, its own memory);
        the mean over the R, dense. Its bytes join the message's transfers."""
        stage = self.scheme.replicate_stage(shards, 1)
        learner, learners = dist.get_rank(group), dist.get_world_size(group)
        index = m * shards + self.rank % shards
        if shard.numel() != stage.plan.messages[index].numel:
            raise UsageError(
                f"FSDP unit {self.plan.messages[m].name}: a shard of {shard.numel()} values, "
                f"not {stage.plan.messages[index].numel}: gradstat cannot compress its "
                "replicate stage"
            )
        outcome = self._compressed(stage, index, shard, learner, learners, group, learner)
        with self._lock:
            sent, estimate, transfers, selected, overhead = self._results[m]
            transfers += outcome.transfers
            overhead += outcome.overhead_bytes
            self._results[m] = (sent, estimate, transfers, selected, overhead)
        estimate = outcome.estimate
        return estimate.dense() if isinstance(estimate, SparseRow) else estimate.reshape(-1)

    def _finish_buckets(self, m: int) -> None:
        """Complete the buckets whose messages are all done; at the step's last, close it."""
        with self._lock:
            ready = [entry for entry in self._pending if all(self._done[j] for j in entry[2])]
            self._pending = [entry for entry in self._pending if entry not in ready]
            last = all(self._done)
            if last:
                ordered = [self._results[j] for j in range(len(self._done))]
                self.transfers = tuple(t for r in ordered for t in r[2])
                self.selected = sum(r[3] for r in ordered)
                self.overhead_bytes = sum(r[4] for r in ordered)
                self.step += 1
                self._start_step()
        for bucket, future, _ in ready:
            buffer = bucket.buffer()
            out = torch.empty_like(buffer)
            position = 0
            for param in bucket.parameters():
                offset, numel = self._slots[param]
                out[position : position + numel].copy_(self.estimate[offset : offset + numel])
                position += numel
            future.set_result(out)


def _compression_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: collect the bucket, exchange the messages it completes.

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
    granularity: str = "bucket",
    dense: str | None = None,
    dense_below: int = 0,
    replicate: int = 1,
    **params: float,
):
    """``(hook, state)`` of compressor ``name`` (a registry name or a user's spec, with
    ``+MEMORY``) for ``register_comm_hook``.

    ``ratio`` is the density k/d of sparsifiers (ignored by fixed-rate compressors);
    ``params`` are the registry parameters (``beta=`` for CLT-k, ``rank=`` for PowerSGD,
    ``momentum=`` for DGC, ``levels=``/``bucket=`` for QSGD, ``stages=`` for SIDCo,
    ``threshold=``). ``granularity`` (``bucket[:MB]``, ``model``, ``tensor``), ``dense``
    and ``dense_below`` make the plan, as the replay's options. ``model`` (the DDP model
    or its module) binds the state now, with the DDP model's bucket caps where it is one;
    ``GradientCapture`` binds it otherwise. ``seed`` seeds the random draws, as the
    replay's ``--seed``. ``replicate`` R > 1 (granularity ``unit``): HSDP with both
    stages compressed: the model is ``fully_shard``-ed on its shard groups alone
    (``mesh["shard"]`` of an ``init_device_mesh(..., (R, S), mesh_dim_names=("replicate",
    "shard"))``) and each unit's all-reduce hook runs the replicate stage through the
    compressor (gradstat/hooks/fsdp_compression.py).

    Example::

        hook, state = compression_hook("topk", ratio=0.01, model=ddp)
        ddp.register_comm_hook(state, hook)
    """
    if ratio is not None and not (0.0 < ratio < 1.0 and math.isfinite(ratio)):
        raise UsageError(f"ratio {ratio} is outside (0, 1)")
    state = CompressionState(
        name,
        ratio,
        params,
        process_group=process_group,
        seed=seed,
        granularity=granularity,
        dense=dense,
        dense_below=dense_below,
        replicate=replicate,
    )
    if model is not None:
        state.bind(model)
    return _compression_hook, state
