"""Replay compressors with their error-feedback memories over a capture's recorded steps
(docs/replay.md).

Every selected learner of a step is compressed together, as in training, and the step
is cut into messages as training cuts it: a communication plan
(:mod:`gradstat.compressors.plan`) at a granularity (``model``, ``tensor``,
``bucket[:MB]``, ``unit``; by default the capture's own), with ``dense`` and
``dense_below`` parameters sent uncompressed. Each (compressor, ratio) keeps its own
memory and sees ``p_i = g_i + m_i`` (docs/methods.md 4) per message. The records, per
step and compressor (with ``detail`` per message), are
:mod:`~gradstat.analysis.replay_records`'; the stream block by block is
:mod:`~gradstat.analysis.replay_stream`. Replay is open-loop: it follows the recorded
(uncompressed) trajectory, so it measures error and traffic, not accuracy.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from gradstat import defaults
from gradstat.analysis.compute import Compute
from gradstat.analysis.ef_vectors import warn_gaps
from gradstat.analysis.replay_records import COLUMNS, dense_seconds, step_records, summarize_replay
from gradstat.analysis.replay_stream import memory_bytes_needed, replay_streamed
from gradstat.analysis.selection import Selection, as_link, parse_ratios
from gradstat.compressors.cost import Link
from gradstat.compressors.plan import MIB, Plan, build_plan, unit_members
from gradstat.compressors.registry import CompressorSpec, Scheme, build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.errors import GradstatError, GradstatWarning, UsageError
from gradstat.parallel import Task, planned_workers, run_units
from gradstat.parallel.progress import Progress, no_progress
from gradstat.store import Capture, Layer, Scope
from gradstat.threads import torch_threads

__all__ = [
    "COLUMNS",
    "Replay",
    "ReplayParams",
    "capture_plan",
    "dense_seconds",
    "replay",
    "summarize_replay",
]


def scope_layers(layers: Sequence[Layer], scope: Scope) -> list[Layer]:
    """The layers that tile ``scope``, in the scope's column order."""
    inside = []
    for offset, numel in scope.slices:
        inside += sorted(
            (layer for layer in layers if offset <= layer.offset and layer.stop <= offset + numel),
            key=lambda layer: layer.offset,
        )
    return inside


def default_granularity(cap: Capture) -> tuple[str, int | None]:
    """How the capture was trained: ``(granularity, first bucket bytes)``. DDP: its
    buckets at the caps it recorded (DDP's defaults when it recorded none); FSDP2 its
    units; anything else the whole model."""
    meta = cap.meta
    if meta.get("data_parallel") == "fsdp2" and meta.get("fsdp_units"):
        return "unit", None
    if meta.get("data_parallel") != "ddp":
        return "model", None
    cap_bytes = meta.get("ddp_bucket_cap_bytes")
    if cap_bytes is None:
        return "bucket", None
    first = meta.get("ddp_first_bucket_bytes")
    return f"bucket:{float(cap_bytes) / MIB:g}", None if first is None else int(first)


def capture_plan(
    cap: Capture,
    scope: Scope,
    granularity: str | None = None,
    dense: str | None = None,
    dense_below: int = 0,
    first_bucket_bytes: int | None = None,
    replicate_compressed: bool | None = None,
) -> Plan:
    """The plan of ``scope`` of ``cap`` at ``granularity`` (None: the capture's own,
    :func:`default_granularity`); ``replicate_compressed``: HSDP's replicate stage
    (None: as the capture's units record it)."""
    if granularity is None:
        granularity, first_bucket_bytes = default_granularity(cap)
    layers = scope_layers(cap.layers, scope)
    units = None
    if granularity == "unit":  # FSDP2's units, as the capture recorded them
        units = unit_members(cap.meta.get("fsdp_units"), cap.layers)
    return build_plan(
        layers,
        granularity,
        dense=dense,
        dense_below=dense_below,
        first_bucket_bytes=first_bucket_bytes,
        units=units,
        replicate_compressed=replicate_compressed,
    )


def trained_options(cap: Capture) -> dict:
    """The plan options a run trained with a compression hook recorded
    (``compressor_plan``, gradstat/hooks/compression.py): :func:`capture_plan`'s keyword
    arguments that replay it (on its own capture or a dense run's of the same model);
    the whole model for a run that recorded none."""
    recorded = cap.meta.get("compressor_plan")
    return json.loads(recorded) if recorded else {"granularity": "model"}


@dataclass(frozen=True)
class ReplayParams:
    """The replay's parameters: ``compressors`` (``"topk,dgc"`` or specs), ``ratios``,
    the ``link`` of the cost model, ``cost_learners`` (cluster size for the cost model;
    None: the replayed learners), ``seed``, the plan (``granularity``: None for the
    capture's own; ``dense``: a regex of parameters sent uncompressed; ``dense_below``:
    parameters of fewer values sent so), ``skip_unfit`` (skip, with one warning, a
    compressor or ratio that cannot run instead of failing), ``optional`` (names of
    compressors skipped that way even without ``skip_unfit``: the command line's default
    set, whose PowerSGD has nothing to compress in a model of vectors), ``tolerate``
    (a candidate that fails is one warning naming it and the others still run:
    recommend and report), ``detail`` (records per message too) and ``threads``, the
    torch threads compression runs and is timed on (``compress_seconds``)."""

    compressors: tuple[CompressorSpec, ...] = defaults.REPLAYED  # as `gradstat replay`
    ratios: tuple[float, ...] = defaults.RATIOS
    link: Link = None  # a Link, "10Gbit/s[,5us]" or (bandwidth, latency); None: defaults
    cost_learners: int | None = None
    seed: int = 0
    skip_unfit: bool = False
    optional: tuple[str, ...] = ()
    threads: int = 1
    granularity: str | None = None
    dense: str | None = None
    dense_below: int = 0
    tolerate: bool = False
    detail: bool = False

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise UsageError(f"threads={self.threads}: use at least 1")
        specs = self.compressors
        specs = parse_compressors(specs) if isinstance(specs, str) else tuple(specs)
        object.__setattr__(self, "compressors", tuple(specs))
        object.__setattr__(self, "ratios", tuple(parse_ratios(self.ratios)))
        object.__setattr__(self, "link", as_link(self.link))
        if self.cost_learners is not None:
            object.__setattr__(self, "cost_learners", int(self.cost_learners))
        if self.cost_learners is not None and self.cost_learners < 1:
            raise UsageError(
                f"cost_learners={self.cost_learners}: the cost model needs at least one learner"
            )


def _warn_failed(label: str, exc: BaseException) -> None:
    warnings.warn(f"{label} left out: {exc}", GradstatWarning, stacklevel=3)


class Replay:
    """A prepared replay: every (scope, compressor, ratio) built on its scope's plan.

    ``params.cost_learners`` evaluates the cost model for another cluster size than the
    number of replayed learners (errors and build-up stay those measured). A compressor
    that cannot run on a scope's plan (PowerSGD without a matrix) fails, unless
    ``skip_unfit`` is set or there are several scopes (``layers``): then it is skipped
    with one warning; with ``tolerate`` any candidate that fails is one warning. Units:
    groups of schemes (indices into ``schemes``), each replayed over every step
    (:meth:`run`).
    """

    def __init__(
        self,
        capture: Capture,
        selection: Selection | None = None,
        params: ReplayParams | None = None,
        *,
        compute: Compute | None = None,
        warn: bool = True,
    ) -> None:
        if params is None:
            raise UsageError("a replay needs parameters: ReplayParams(compressors, ratios, link)")
        self.capture = capture
        self.selection = selection or Selection.of(capture)
        self.params = params
        self.compute = compute or Compute()
        self.link = params.link
        self.steps = list(self.selection.steps)
        self.learners = list(self.selection.learners)
        # the cluster whose communication is modelled: the learners the user selected,
        # else the run's (also when only a sample of its learners recorded)
        chose = self.selection.learners != tuple(capture.learners)
        self.cost_learners = params.cost_learners or (
            len(self.learners) if chose else capture.world_size
        )
        self.plans = {
            sc.name: capture_plan(capture, sc, params.granularity, params.dense, params.dense_below)
            for sc in self.selection.scopes(capture)
        }
        self._check_shard_groups(capture)
        self.schemes, skipped = self._schemes(capture, params, warn)
        if not self.schemes:
            reason = f" ({skipped[0]})" if skipped else ""
            raise UsageError(f"no compressor can run here{reason}")
        if skipped and warn:
            warnings.warn(
                f"skipped {len(skipped)} (scope, compressor) combination(s) that cannot "
                f"run, e.g. {skipped[0]}",
                GradstatWarning,
                stacklevel=2,
            )

    def _check_shard_groups(self, capture: Capture) -> None:
        """HSDP units (``Message.replicate`` > 1) are exchanged within shard groups of
        consecutive learners: the replay needs every learner of the run."""
        replicas = max((m.replicate for p in self.plans.values() for m in p.messages), default=1)
        if replicas > 1 and self.learners != list(range(capture.world_size)):
            raise UsageError(
                f"the capture's FSDP units are replicated over {replicas} shard groups "
                "(HSDP): --granularity unit exchanges each message within its group and "
                f"needs all {capture.world_size} learners, not {len(self.learners)}; "
                "replay them all, or choose another --granularity"
            )

    @property
    def plan(self) -> Plan:
        """The plan of the first scope (every answer says which granularity ran)."""
        return next(iter(self.plans.values()))

    def _schemes(
        self, capture: Capture, params: ReplayParams, warn: bool
    ) -> tuple[list[tuple[Scope, Scheme]], list[str]]:
        """Each (scope, compressor, ratio)'s scheme, and why each that cannot run was left
        out: a compressor asked for by name that cannot run on a single scope raises."""
        schemes: list[tuple[Scope, Scheme]] = []
        scopes = self.selection.scopes(capture)
        skip = params.skip_unfit or len(scopes) > 1
        skipped: list[str] = []
        for sc in scopes:
            for spec in params.compressors:
                for ratio in [None] if spec.fixed_rate else params.ratios:
                    try:
                        scheme = build_scheme(spec, ratio, self.plans[sc.name], seed=params.seed)
                    except UsageError as exc:
                        if not skip and spec.name not in params.optional and not params.tolerate:
                            raise
                        skipped.append(f"{sc.name}: {exc}")
                        continue
                    except GradstatError as exc:  # the user's code failed
                        if not params.tolerate:
                            raise
                        if warn:
                            _warn_failed(spec.label, exc)
                        continue
                    schemes.append((sc, scheme))
        return schemes, skipped

    def run(
        self, progress: Progress = no_progress, only: Sequence[int] | None = None
    ) -> pd.DataFrame:
        """Every scheme (or those of indices ``only``) over every step; one record per
        step and scheme (and with ``detail`` per message), in that order.

        Units: as many groups of schemes as processes will run them (``--jobs`` x
        torchrun ranks; schemes dealt round-robin), each group replayed over every step,
        so one process reads each step once."""
        warn_gaps(self.steps, "replay")
        steps = len(self.steps)
        task = Task(replay_unit, str(self.capture.path), self.selection, self.params, parts=steps)
        workers = planned_workers(self.capture, self.selection, self.compute.jobs)
        chosen = list(range(len(self.schemes)) if only is None else only)
        groups = min(len(chosen), workers)
        units = [tuple(chosen[g::groups]) for g in range(groups)]
        records = run_units(self.capture, task, units, self.compute, progress)
        if not records:
            raise UsageError("every candidate failed: nothing to compare (see the warnings)")
        position = {step: i for i, step in enumerate(self.steps)}
        records.sort(key=lambda record: (position[record["step"]], record.pop("scheme")))
        return pd.DataFrame.from_records(records, columns=list(COLUMNS))

    def replay_schemes(
        self, indices: Sequence[int], tick: Callable[[], None] = lambda: None
    ) -> list[dict]:
        """Records of the schemes ``indices`` over every step (:meth:`stream_records`); a
        scheme that fails with ``tolerate`` is one warning naming it, and none of its
        records stay."""
        chosen = {i: self.schemes[i] for i in indices}
        records: list[dict] = []
        failed: dict[int, BaseException] = {}
        warned = 0
        for found in self.stream_records(chosen, self.link, failed, self.params.detail):
            for i in list(failed)[warned:]:
                _warn_failed(chosen[i][1].spec.label, failed[i])
            warned = len(failed)
            records += found
            tick()  # one more step of this unit
        return [record for record in records if record["scheme"] not in failed]

    def stream_records(
        self,
        chosen: Mapping[int, tuple[Scope, Scheme]],
        link: Link,
        failed: dict[int, BaseException],
        detail: bool = False,
    ) -> Iterator[list[dict]]:
        """Each step's records of the ``chosen`` schemes (key ``scheme``: their index),
        their communication costed on ``link``; the error-feedback memories in RAM, or in
        a scratch file when they exceed the memory budget. A scheme that fails (with
        ``tolerate``) goes into ``failed`` with its error and has no records from then on."""
        n, schemes = len(self.learners), list(chosen.values())
        scratch = memory_bytes_needed([s for _, s in schemes], n) > self.compute.memory_bytes()
        with torch_threads(self.params.threads):
            stream = replay_streamed(
                self.capture,
                self.steps,
                self.learners,
                schemes,
                scratch=scratch,
                tolerate=self.params.tolerate,
            )
            with contextlib.closing(stream):
                for step, results in stream:
                    found: list[dict] = []
                    for i, (sc, scheme), result in zip(chosen, schemes, results, strict=True):
                        if result.error is not None:
                            failed.setdefault(i, result.error)
                            continue
                        records = step_records(
                            step, sc.name, scheme, result, n, self.cost_learners, link, detail
                        )
                        found += [{**record, "scheme": i} for record in records]
                    yield found


def replay_unit(
    cap: Capture,
    selection: Selection,
    params: ReplayParams,
    compute: Compute,
    schemes: Sequence[int],
    tick: Callable[[], None] = lambda: None,
) -> list[dict]:
    """Records of a group of schemes (indices into ``Replay.schemes``) over every step;
    ``tick()`` after each step."""
    replay = Replay(cap, selection, params, compute=compute, warn=False)
    return replay.replay_schemes(schemes, tick)


def replay(
    capture: Capture,
    selection: Selection | None = None,
    params: ReplayParams | None = None,
    *,
    compute: Compute | None = None,
    progress: Progress = no_progress,
) -> pd.DataFrame:
    """Replay ``params.compressors`` at ``params.ratios`` over ``capture``: per-step
    records (COLUMNS)."""
    return Replay(capture, selection, params, compute=compute).run(progress)
