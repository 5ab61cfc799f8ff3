"""Replay compressors with error feedback over a capture's recorded steps.

Every selected learner of a step is compressed together, as in training: each
(compressor, ratio) keeps its own error-feedback memory, sees ``p_i = g_i + m_i``
(METHODS.md 4) and produces the aggregate every learner would hold. Per step and
compressor the replay records the achieved density and estimation quality
``q = selected / k``, the union of the sent indices and build-up ``B = U / k`` (METHODS.md
3), the exact bytes each learner sends, the predicted communication time of the
alpha-beta model (METHODS.md 5), the relative error ``||g_hat - g_ref||^2 / ||g_ref||^2``
and cosine similarity against the true mean gradient (for DGC the dense momentum update),
the mean memory norm and the compression time per learner.

Replay is open-loop: it follows the recorded (uncompressed) trajectory, so it measures
error and traffic, not accuracy. Memory is bounded by one step of all selected learners
plus each compressor's memory (one row per learner).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from gradstat.analysis.finite import require_finite
from gradstat.analysis.progress import Progress, no_progress
from gradstat.analysis.selection import k_for, parse_ratios, select_learners, select_steps
from gradstat.compressors.base import Exchange
from gradstat.compressors.cost import Link, allreduce_seconds, collective_seconds
from gradstat.compressors.registry import (
    CompressorSpec,
    Scheme,
    build_scheme,
    parse_compressors,
)
from gradstat.errors import GradstatWarning, UsageError
from gradstat.store import Capture, Layer, Scope

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


def check_gaps(recorded: Sequence[int], chosen: Sequence[int]) -> None:
    """Warn when the replayed steps are not consecutive training steps."""
    positions = np.searchsorted(np.asarray(recorded), np.asarray(chosen))
    jumps = [
        (a, b)
        for a, b, pa, pb in zip(chosen, chosen[1:], positions, positions[1:], strict=False)
        if b - a != 1 or pb - pa != 1
    ]
    if jumps:
        a, b = jumps[0]
        warnings.warn(
            f"the replayed steps have {len(jumps)} gap(s), e.g. step {a} -> {b}: error "
            "feedback skips the missing steps, so memories differ from training",
            GradstatWarning,
            stacklevel=3,
        )


def _error_and_cosine(estimate: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    estimate, reference = estimate.double(), reference.double()
    ref_sq = float(reference.square().sum())
    est_norm = float(torch.linalg.vector_norm(estimate))
    err = float((estimate - reference).square().sum())
    rel = err / ref_sq if ref_sq > 0 else math.nan
    denominator = est_norm * math.sqrt(ref_sq)
    cos = float(estimate @ reference) / denominator if denominator > 0 else math.nan
    return rel, cos


def _multiplicity(exchange: Exchange, collective: str) -> list[int] | None:
    """All-gathered sparse sets: h(c), c = 1..n, how many coordinates exactly c learners
    sent (for the build-up curve B(m), :func:`gradstat.stats.topk_sets.buildup_curve`)."""
    if collective != "allgather" or exchange.union is None:
        return None
    n = exchange.sent.shape[0]
    holders = torch.count_nonzero(exchange.sent, dim=0)
    return torch.bincount(holders, minlength=n + 1)[1:].tolist()


class Replay:
    """A prepared replay: selections checked and every (scope, compressor, ratio) built.

    ``cost_learners`` evaluates the cost model for another cluster size than the number
    of replayed learners (errors and build-up stay those measured). A compressor or ratio
    that cannot run on a scope (a ratio keeping less than one element, PowerSGD without a
    matrix) fails, unless ``skip_unfit`` is set or there are several scopes (``layers``):
    then it is skipped with one warning.
    """

    def __init__(
        self,
        capture: Capture,
        compressors: str | Sequence[CompressorSpec],
        ratios: str | Sequence[float],
        *,
        link: Link,
        scope: str = "model",
        steps: str | None = None,
        learners: str | None = None,
        cost_learners: int | None = None,
        seed: int = 0,
        skip_unfit: bool = False,
    ) -> None:
        specs = parse_compressors(compressors) if isinstance(compressors, str) else compressors
        ratio_list = parse_ratios(ratios)
        self.capture = capture
        self.link = link
        self.steps = select_steps(capture.steps, steps)
        self.learners = select_learners(capture.learners, learners)
        # the cluster whose communication is modelled: the learners the user selected,
        # else the run's (also when only a sample of its learners recorded)
        self.cost_learners = cost_learners or (
            len(self.learners) if learners else capture.world_size
        )
        if self.cost_learners < 1:
            raise UsageError(f"the cost model needs at least one learner, got {cost_learners}")
        self.schemes: list[tuple[Scope, Scheme]] = []
        scopes = capture.scopes(scope)
        skip = skip_unfit or len(scopes) > 1
        skipped: list[str] = []
        for sc in scopes:
            shapes = scope_shapes(capture.layers, sc)
            for spec in specs:
                for ratio in [None] if spec.fixed_rate else ratio_list:
                    k = None if ratio is None else k_for(ratio, sc.numel)
                    try:
                        scheme = build_scheme(
                            spec, ratio, k, numel=sc.numel, shapes=shapes, seed=seed
                        )
                    except UsageError as exc:
                        if not skip:
                            raise
                        skipped.append(f"{sc.name}: {exc}")
                        continue
                    self.schemes.append((sc, scheme))
        if not self.schemes:
            reason = f" ({skipped[0]})" if skipped else ""
            raise UsageError(f"no compressor can run at the given ratios here{reason}")
        if skipped:
            warnings.warn(
                f"skipped {len(skipped)} (scope, compressor, ratio) combination(s) that "
                f"cannot run, e.g. {skipped[0]}",
                GradstatWarning,
                stacklevel=2,
            )

    def run(self, progress: Progress = no_progress) -> pd.DataFrame:
        """Walk the steps once, all schemes side by side; one record per step and scheme."""
        check_gaps([int(s) for s in self.capture.steps], self.steps)
        n = len(self.learners)
        records = []
        for step, grads in progress(self.capture.iter_steps(self.steps, self.learners)):
            require_finite(step, grads, self.learners, "replay")
            for sc, scheme in self.schemes:
                records.append(self._step(step, sc.name, sc.take(grads), scheme, n))
        return pd.DataFrame.from_records(records, columns=list(COLUMNS))

    def _step(self, step: int, scope: str, grads: torch.Tensor, scheme: Scheme, n: int) -> dict:
        d = grads.shape[1]
        reference = scheme.reference(grads.mean(dim=0))
        start = time.perf_counter()
        exchange = scheme.step(grads)
        compress_seconds = (time.perf_counter() - start) / n
        rel_error, cosine = _error_and_cosine(exchange.estimate, reference)
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
            "compression": d * grads.element_size() / sent_bytes,
            "comm_seconds": comm,
            "compress_seconds": compress_seconds,
            "rel_error": rel_error,
            "cosine": cosine,
            "memory_norm": scheme.memory.norm(),
            "threshold": exchange.info.get("threshold", math.nan),
            "stages": exchange.info.get("stages", math.nan),
            "multiplicity": _multiplicity(exchange, scheme.compressor.collective),
        }


def replay(
    capture: Capture,
    compressors: str | Sequence[CompressorSpec],
    ratios: str | Sequence[float],
    *,
    link: Link,
    scope: str = "model",
    steps: str | None = None,
    learners: str | None = None,
    cost_learners: int | None = None,
    seed: int = 0,
    progress: Progress = no_progress,
) -> pd.DataFrame:
    """Replay ``compressors`` at ``ratios`` over ``capture``: per-step records (COLUMNS)."""
    return Replay(
        capture,
        compressors,
        ratios,
        link=link,
        scope=scope,
        steps=steps,
        learners=learners,
        cost_learners=cost_learners,
        seed=seed,
    ).run(progress)


def summarize_replay(records: pd.DataFrame, link: Link, n: int) -> pd.DataFrame:
    """One row per (scope, compressor, ratio): means over steps, the final memory norm,
    predicted time per step (communication + compression) and the speed-up over the dense
    fp32 ring all-reduce of the same scope on ``n`` learners."""
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
            "compress_seconds",
            "rel_error",
            "cosine",
        ]
    ].mean()
    summary = means.assign(
        memory_norm=grouped["memory_norm"].last(),
        steps=grouped["step"].count(),
        collective=grouped["collective"].first(),
        numel=grouped["numel"].first(),
    ).reset_index()
    summary["seconds"] = summary["comm_seconds"] + summary["compress_seconds"]
    dense = summary["numel"].map(lambda d: dense_seconds(int(d), n, link))
    summary["speedup"] = dense / summary["seconds"]
    return summary
