"""Replay compressors with error feedback over a capture's recorded steps.

Every selected learner of a step is compressed together, as in training: each
(compressor, ratio) keeps its own error-feedback memory, sees ``p_i = g_i + m_i``
(docs/methods.md 4) and produces the aggregate every learner would hold. Per step and
compressor the replay records the achieved density and estimation quality
``q = selected / k``, the union of the sent indices and build-up ``B = U / k`` (docs/methods.md
3), the exact bytes each learner sends, the predicted communication time of the
alpha-beta model (docs/methods.md 5), the relative error ``||g_hat - g_ref||^2 / ||g_ref||^2``
and cosine similarity against the true mean gradient (for DGC the dense momentum update),
the mean memory norm and the compression time per learner.

Replay is open-loop: it follows the recorded (uncompressed) trajectory, so it measures
error and traffic, not accuracy. It streams (:mod:`~gradstat.analysis.replay_stream`):
beyond each compressor's error-feedback memories (one row per learner, in RAM or a
scratch file) and its aggregate, a few rows of one learner are alive at a time.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from gradstat import defaults
from gradstat.analysis.compute import Compute
from gradstat.analysis.ef_vectors import warn_gaps
from gradstat.analysis.replay_stream import (
    SchemeStep,
    SparseRow,
    memory_bytes_needed,
    replay_streamed,
)
from gradstat.analysis.selection import Selection, as_link, k_for, parse_ratios
from gradstat.compressors.cost import Link, allreduce_seconds, collective_seconds
from gradstat.compressors.registry import CompressorSpec, Scheme, build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.errors import GradstatWarning, UsageError
from gradstat.parallel import Task, planned_workers, run_units
from gradstat.parallel.progress import Progress, no_progress
from gradstat.stats.row_kernels import error_sums, squared_norm
from gradstat.store import Capture, Layer, Scope
from gradstat.threads import torch_threads

#: Columns of the per-step records, in order.
COLUMNS = (
    "scope",
    "compressor",
    "ratio",
    "step",
    "collective",
    "numel",
    "k",
    "density",
    "quality",
    "union",
    "buildup",
    "bytes_per_learner",
    "gathered_bytes",
    "compression",
    "comm_seconds",
    "compress_seconds",
    "rel_error",
    "cosine",
    "memory_norm",
    "threshold",
    "stages",
    "multiplicity",
)


def scope_shapes(layers: Sequence[Layer], scope: Scope) -> list[tuple[int, ...]]:
    """Shapes of the parameters that tile ``scope``, in the scope's column order."""
    shapes = []
    for offset, numel in scope.slices:
        inside = [
            layer for layer in layers if offset <= layer.offset and layer.stop <= offset + numel
        ]
        shapes.extend(layer.shape for layer in sorted(inside, key=lambda layer: layer.offset))
    return shapes


def dense_seconds(numel: int, n: int, link: Link, bytes_per_value: int = 4) -> float:
    """Predicted time of the uncompressed ring all-reduce (fp32: 4 bytes, fp16: 2)."""
    return allreduce_seconds(numel * bytes_per_value, n, link)


def error_and_cosine(
    estimate: torch.Tensor | SparseRow, reference: torch.Tensor
) -> tuple[float, float]:
    """``||e - r||^2 / ||r||^2`` and ``cos(e, r)``, summed in float64: float32 rows on the
    CPU in one pass (:func:`~gradstat.stats.row_kernels.error_sums`; 8M values 3 ms
    against 10 ms in float64 chunks), a sparse ``e`` from ``||r||^2`` and its indices
    alone (:func:`_sparse_error_sums`), anything else as float64 tensors."""
    if isinstance(estimate, SparseRow):
        return _ratios(*_sparse_error_sums(estimate, reference.detach().reshape(-1)))
    rows = [v.detach().reshape(-1) for v in (estimate, reference)]
    if all(v.device.type == "cpu" and v.dtype == torch.float32 for v in rows):
        e, r = (np.ascontiguousarray(v.numpy()) for v in rows)
        ref_sq, est_sq, dot, err = error_sums(e, r)
    else:
        e, r = (v.double() for v in rows)
        d = e - r
        ref_sq, est_sq, dot, err = (float(a @ b) for a, b in ((r, r), (e, e), (e, r), (d, d)))
    return _ratios(ref_sq, est_sq, dot, err)


def _sparse_error_sums(estimate: SparseRow, r: torch.Tensor) -> tuple[float, float, float, float]:
    """(||r||^2, ||e||^2, e . r, ||e - r||^2) for an ``e`` that is zero outside its
    indices U, in float64: ||e - r||^2 = ||r||^2 - sum_U r_i^2 + sum_U (e_i - r_i)^2, one
    pass over ``r`` and the rest at U. The subtraction cancels only where U holds nearly
    all of ||r||^2: the relative error is then off by the rounding of two float64 sums
    of the same squares in different orders, a few 1e-15 (and kept from going below 0)."""
    if r.device.type == "cpu" and r.dtype == torch.float32:
        ref_sq = squared_norm(np.ascontiguousarray(r.numpy()))
    else:
        ref_sq = float(r.double().square().sum())
    at = r[estimate.indices.to(r.device)].double()
    e = estimate.values.to(r.device).double()
    left = e - at
    err = max(0.0, ref_sq - float(at @ at) + float(left @ left))
    return ref_sq, float(e @ e), float(e @ at), err


def _ratios(ref_sq: float, est_sq: float, dot: float, err: float) -> tuple[float, float]:
    """The relative error and cosine from the four sums."""
    rel = err / ref_sq if ref_sq > 0 else math.nan
    denominator = math.sqrt(est_sq) * math.sqrt(ref_sq)
    cos = dot / denominator if denominator > 0 else math.nan
    return rel, cos


@dataclass(frozen=True)
class ReplayParams:
    """The replay's parameters: ``compressors`` (``"topk,dgc"`` or specs), ``ratios``,
    the ``link`` of the cost model, ``cost_learners`` (cluster size for the cost model;
    None: the replayed learners), ``seed``, ``skip_unfit`` (skip, with one warning,
    a compressor or ratio that cannot run on a scope instead of failing), ``optional``
    (names of compressors skipped that way even without ``skip_unfit``: the command
    line's default set, whose PowerSGD has nothing to compress in a model of vectors)
    and ``threads``, the torch threads compression runs and is timed on
    (``compress_seconds``)."""

    compressors: tuple[CompressorSpec, ...] = defaults.REPLAYED  # as `gradstat replay`
    ratios: tuple[float, ...] = defaults.RATIOS
    link: Link = None  # a Link, "10Gbit/s[,5us]" or (bandwidth, latency); None: defaults
    cost_learners: int | None = None
    seed: int = 0
    skip_unfit: bool = False
    optional: tuple[str, ...] = ()
    threads: int = 1

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


class Replay:
    """A prepared replay: every (scope, compressor, ratio) built.

    ``params.cost_learners`` evaluates the cost model for another cluster size than the
    number of replayed learners (errors and build-up stay those measured). A compressor
    or ratio that cannot run on a scope (a ratio keeping less than one element, PowerSGD
    without a matrix) fails, unless ``skip_unfit`` is set or there are several scopes
    (``layers``): then it is skipped with one warning. Units: groups of schemes (indices
    into ``schemes``), each replayed over every step (:meth:`run`).
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
        self.schemes, skipped = self._schemes(capture, params)
        if not self.schemes:
            reason = f" ({skipped[0]})" if skipped else ""
            raise UsageError(f"no compressor can run at the given ratios here{reason}")
        if skipped and warn:
            warnings.warn(
                f"skipped {len(skipped)} (scope, compressor, ratio) combination(s) that "
                f"cannot run, e.g. {skipped[0]}",
                GradstatWarning,
                stacklevel=2,
            )

    def _schemes(
        self, capture: Capture, params: ReplayParams
    ) -> tuple[list[tuple[Scope, Scheme]], list[str]]:
        """Each (scope, compressor, ratio)'s scheme, and why each that cannot run was left
        out: a compressor asked for by name that cannot run on a single scope raises."""
        schemes: list[tuple[Scope, Scheme]] = []
        scopes = self.selection.scopes(capture)
        skip = params.skip_unfit or len(scopes) > 1
        skipped: list[str] = []
        for sc in scopes:
            shapes = scope_shapes(capture.layers, sc)
            for spec in params.compressors:
                for ratio in [None] if spec.fixed_rate else params.ratios:
                    k = None if ratio is None else k_for(ratio, sc.numel)
                    try:
                        scheme = build_scheme(
                            spec, ratio, k, numel=sc.numel, shapes=shapes, seed=params.seed
                        )
                    except UsageError as exc:
                        if not skip and spec.name not in params.optional:
                            raise
                        skipped.append(f"{sc.name}: {exc}")
                        continue
                    schemes.append((sc, scheme))
        return schemes, skipped

    def run(self, progress: Progress = no_progress) -> pd.DataFrame:
        """Every scheme over every step; one record per step and scheme, in that order.

        Units: as many groups of schemes as processes will run them (``--jobs`` x
        torchrun ranks; schemes dealt round-robin), each group replayed over every step,
        so one process reads each step once."""
        warn_gaps(self.steps, "replay")
        steps = len(self.steps)
        task = Task(replay_unit, str(self.capture.path), self.selection, self.params, parts=steps)
        workers = planned_workers(self.capture, self.selection, self.compute.jobs)
        groups = min(len(self.schemes), workers)
        units = [tuple(range(g, len(self.schemes), groups)) for g in range(groups)]
        records = run_units(self.capture, task, units, self.compute, progress)
        position = {step: i for i, step in enumerate(self.steps)}
        records.sort(key=lambda record: (position[record["step"]], record.pop("scheme")))
        return pd.DataFrame.from_records(records, columns=list(COLUMNS))

    def replay_schemes(
        self, indices: Sequence[int], tick: Callable[[], None] = lambda: None
    ) -> list[dict]:
        """Records of the schemes ``indices`` over every step (key ``scheme``: the index),
        streamed one learner's row at a time; the error-feedback memories in RAM, or in a
        scratch file when they exceed the memory budget (``replay_stream``)."""
        n = len(self.learners)
        chosen = [self.schemes[i] for i in indices]
        needed = memory_bytes_needed([s for _, s in chosen], n, [sc.numel for sc, _ in chosen])
        scratch = needed > self.compute.memory_bytes()
        records = []
        with torch_threads(self.params.threads):
            for step, results in replay_streamed(
                self.capture, self.steps, self.learners, chosen, scratch=scratch
            ):
                for i, (sc, scheme), result in zip(indices, chosen, results, strict=True):
                    record = self._record(step, sc.name, scheme, result, n)
                    records.append({**record, "scheme": i})
                tick()  # one more step of this unit
        return records

    def _record(self, step: int, scope: str, scheme: Scheme, result: SchemeStep, n: int) -> dict:
        exchange = result.outcome
        d = result.reference.numel()
        rel_error, cosine = error_and_cosine(exchange.estimate, result.reference)
        k = scheme.compressor.k
        mean_selected = sum(exchange.selected) / n
        sent_bytes = exchange.bytes_per_learner
        comm = sum(
            collective_seconds(t.collective, t.nbytes, self.cost_learners, self.link)
            for t in exchange.transfers
        )
        return {
            "scope": scope,
            "compressor": scheme.spec.label,
            "ratio": scheme.ratio if scheme.ratio is not None else math.nan,
            "step": step,
            "collective": scheme.compressor.collective,
            "numel": d,
            "k": k if k is not None else d,
            "density": mean_selected / d,
            "quality": mean_selected / k if k else math.nan,
            "union": exchange.union if exchange.union is not None else math.nan,
            "buildup": exchange.union / k if k and exchange.union is not None else math.nan,
            "bytes_per_learner": sent_bytes,
            "gathered_bytes": exchange.gathered_bytes if exchange.gathered_bytes else math.nan,
            # a threshold can select nothing (Gaussian-k's 2 adjustments at tiny k)
            "compression": d * 4 / sent_bytes if sent_bytes else math.inf,
            "comm_seconds": comm,
            "compress_seconds": result.compress_seconds,
            "rel_error": rel_error,
            "cosine": cosine,
            "memory_norm": exchange.memory_norm,
            "threshold": exchange.info.get("threshold", math.nan),
            "stages": exchange.info.get("stages", math.nan),
            "multiplicity": exchange.multiplicity,
        }


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


def warm_compress_seconds(records: pd.DataFrame) -> pd.DataFrame:
    """Per (scope, compressor, ratio), the compression time of the warm steps: the
    ``median`` over every replayed step after the first (the first pays one-time costs:
    allocations, a compiled kernel's first call; 85 ms against 0.3 ms for CLT-k) and its
    ``spread``, interquartile range / median. With one step, that step."""
    keys = ["scope", "compressor", "ratio"]
    first = records.groupby(keys, sort=False, dropna=False)["step"].transform("first")
    several = records.groupby(keys, sort=False, dropna=False)["step"].transform("count") > 1
    warm = records[(records["step"] != first) | ~several]
    seconds = warm.groupby(keys, sort=False, dropna=False)["compress_seconds"]
    median = seconds.median()
    spread = (seconds.quantile(0.75) - seconds.quantile(0.25)) / median.where(median > 0)
    return pd.DataFrame({"median": median, "spread": spread.fillna(0.0)})


def summarize_replay(records: pd.DataFrame, link: Link, n: int) -> pd.DataFrame:
    """One row per (scope, compressor, ratio): means over steps, the compression time of
    the warm steps (:func:`warm_compress_seconds`: ``compress_seconds`` and its
    ``compress_spread``), the final memory norm, predicted time per step (communication +
    compression) and the speed-up over the dense fp32 ring all-reduce of the same scope
    on ``n`` learners."""
    grouped = records.groupby(["scope", "compressor", "ratio"], sort=False, dropna=False)
    means = grouped[
        [
            "k",
            "density",
            "quality",
            "buildup",
            "bytes_per_learner",
            "compression",
            "comm_seconds",
            "rel_error",
            "cosine",
        ]
    ].mean()
    warm = warm_compress_seconds(records)
    summary = means.assign(
        compress_seconds=warm["median"],
        compress_spread=warm["spread"],
        memory_norm=grouped["memory_norm"].last(),
        steps=grouped["step"].count(),
        collective=grouped["collective"].first(),
        numel=grouped["numel"].first(),
    ).reset_index()
    summary["seconds"] = summary["comm_seconds"] + summary["compress_seconds"]
    dense = summary["numel"].map(lambda d: dense_seconds(int(d), n, link))
    summary["speedup"] = dense / summary["seconds"]
    return summary
