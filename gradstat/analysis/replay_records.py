"""The replay's records: one per (step, compressor, ratio) with the whole step's totals,
and with ``detail`` one per message, from a scheme's step (:class:`~gradstat.analysis.
replay_stream.SchemeStep`); and their summaries.

A step's totals over the plan's messages: bytes per learner, values sent, build-up
(``union`` over ``k``, both summed over the compressed messages), the predicted
communication time (every message's collectives), the error and cosine of the whole
model's aggregate against the mean gradient (float64 sums over every message), the
learners' memory norms (the root of each learner's squares over the messages, averaged).
Density, quality and build-up are counted from the payloads (docs/replay.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from gradstat.analysis.replay_block import MessageOutcome
from gradstat.analysis.replay_stream import SchemeStep
from gradstat.compressors.cost import Link, allreduce_seconds, collective_seconds
from gradstat.compressors.exchange import SparseRow
from gradstat.compressors.registry import Scheme
from gradstat.stats.row_kernels import error_sums as row_error_sums
from gradstat.stats.row_kernels import squared_norm

#: Columns of the per-step records, in order.
COLUMNS = (
    "scope",
    "message",
    "compressor",
    "memory",
    "granularity",
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
KEYS = ["scope", "compressor", "ratio"]


def dense_seconds(numel: int, n: int, link: Link, bytes_per_value: int = 4) -> float:
    """Predicted time of the uncompressed ring all-reduce (fp32: 4 bytes, fp16: 2)."""
    return allreduce_seconds(numel * bytes_per_value, n, link)


def error_sums(estimate: torch.Tensor | SparseRow, reference: torch.Tensor) -> np.ndarray:
    """``(||r||^2, ||e||^2, e . r, ||e - r||^2)`` in float64: float32 rows on the CPU in
    one pass (:func:`~gradstat.stats.row_kernels.error_sums`), a sparse ``e`` from
    ``||r||^2`` and its indices alone (||e - r||^2 = ||r||^2 - sum_U r_i^2 + sum_U (e_i -
    r_i)^2; the subtraction cancels only where U holds nearly all of ||r||^2, then off by
    a few 1e-15 of it, kept from going below 0), anything else as float64 tensors."""
    r = reference.detach().reshape(-1)
    if isinstance(estimate, SparseRow):
        if r.device.type == "cpu" and r.dtype == torch.float32:
            ref_sq = squared_norm(np.ascontiguousarray(r.numpy()))
        else:
            ref_sq = float(r.double().square().sum())
        at = r[estimate.indices.long().to(r.device)].double()
        e = estimate.values.to(r.device).double()
        left = e - at
        err = max(0.0, ref_sq - float(at @ at) + float(left @ left))
        return np.array([ref_sq, float(e @ e), float(e @ at), err])
    e = estimate.detach().reshape(-1)
    if all(v.device.type == "cpu" and v.dtype == torch.float32 for v in (e, r)):
        return np.array(
            row_error_sums(np.ascontiguousarray(e.numpy()), np.ascontiguousarray(r.numpy()))
        )
    e, r = e.double(), r.double()
    d = e - r
    return np.array([float(a @ b) for a, b in ((r, r), (e, e), (e, r), (d, d))])


def ratios(sums: np.ndarray) -> tuple[float, float]:
    """The relative error and cosine from the four sums of :func:`error_sums`."""
    ref_sq, est_sq, dot, err = (float(v) for v in sums)
    rel = err / ref_sq if ref_sq > 0 else math.nan
    denominator = math.sqrt(est_sq) * math.sqrt(ref_sq)
    return rel, dot / denominator if denominator > 0 else math.nan


def _mean_info(outcomes: Sequence[MessageOutcome], key: str) -> float:
    values = [o.info[key] for o in outcomes if o.info and key in o.info]
    return sum(values) / len(values) if values else math.nan


def _record(
    scheme: Scheme,
    outcomes: Sequence[MessageOutcome],
    sums: np.ndarray,
    seconds: float,
    n: int,
    cost_learners: int,
    link: Link,
) -> dict:
    """The numbers of a set of messages (one, or all of a step's)."""
    plan = scheme.plan
    numel = sum(plan.messages[o.index].numel for o in outcomes)
    compressed = [o for o in outcomes if not plan.messages[o.index].dense]
    ks = [scheme.k(o.index) for o in compressed]
    k = sum(ks) if compressed and None not in ks else None
    sent = sum(sum(o.selected) for o in outcomes) / n
    chosen = sum(sum(o.selected) for o in compressed) / n
    unions = [o.union for o in compressed]
    union = sum(unions) if compressed and None not in unions else None
    transfers = [t for o in outcomes for t in o.transfers]
    sent_bytes = sum(t.nbytes for t in transfers)
    gathered = sum(t.nbytes for t in transfers if t.collective == "allgather") * n
    comm = 0
    for o in outcomes:  # HSDP: a message is exchanged within its shard group, and
        replicate = plan.messages[o.index].replicate  # its replicate stage over R
        group = max(1, cost_learners // replicate)
        first = len(o.transfers) - o.replicated
        for j, t in enumerate(o.transfers):
            learners = group if j < first else min(cost_learners, replicate)
            comm += collective_seconds(t.collective, t.nbytes, learners, link)
    multiplicity = None
    if compressed and all(o.multiplicity is not None for o in compressed):
        multiplicity = np.sum([o.multiplicity for o in compressed], axis=0).tolist()
    squares = np.sum([o.squares for o in outcomes], axis=0)
    rel_error, cosine = ratios(sums)
    return {
        "numel": numel,
        "k": k if k is not None else numel,
        "density": sent / numel,
        "quality": chosen / k if k else math.nan,
        "union": union if union is not None else math.nan,
        "buildup": union / k if k and union is not None else math.nan,
        "bytes_per_learner": sent_bytes,
        "gathered_bytes": gathered if gathered else math.nan,
        # a threshold can select nothing (Gaussian-k's 2 adjustments at tiny k)
        "compression": numel * 4 / sent_bytes if sent_bytes else math.inf,
        "comm_seconds": comm,
        "compress_seconds": seconds,
        "rel_error": rel_error,
        "cosine": cosine,
        "memory_norm": float(np.mean(np.sqrt(squares))),
        "threshold": _mean_info(compressed, "threshold"),
        "stages": _mean_info(compressed, "stages"),
        "multiplicity": multiplicity,
    }


def step_records(
    step: int,
    scope: str,
    scheme: Scheme,
    result: SchemeStep,
    n: int,
    cost_learners: int,
    link: Link,
    detail: bool = False,
) -> list[dict]:
    """The record of one scheme's step at ``scope`` with the whole step's totals, and
    with ``detail`` one more per message (``message`` its name; ``compress_seconds``
    shared out by size)."""
    outcomes = result.messages
    parts = [error_sums(o.estimate, r) for o, r in zip(outcomes, result.references, strict=True)]
    first = scheme.compressor(0, scheme.plan.compressed[0]) if scheme.plan.compressed else None
    base = {
        "scope": scope,
        "message": None,
        "compressor": scheme.spec.label,
        "memory": scheme.memory_label,
        "granularity": scheme.plan.granularity,
        "ratio": scheme.ratio if scheme.ratio is not None else math.nan,
        "step": step,
        "collective": first.collective if first is not None else "allreduce",
    }
    total = _record(
        scheme, outcomes, np.sum(parts, axis=0), result.compress_seconds, n, cost_learners, link
    )
    records = [{**base, **total}]
    if detail:
        d = scheme.plan.numel
        for outcome, sums in zip(outcomes, parts, strict=True):
            message = scheme.plan.messages[outcome.index]
            seconds = result.compress_seconds * message.numel / d
            one = _record(scheme, [outcome], sums, seconds, n, cost_learners, link)
            records.append({**base, "message": message.name, **one})
    return records


def totals(records: pd.DataFrame) -> pd.DataFrame:
    """The records of whole steps (not of single messages)."""
    if "message" not in records:
        return records
    return records[records["message"].isna()]


def warm_compress_seconds(records: pd.DataFrame) -> pd.DataFrame:
    """Per (scope, compressor, ratio), the compression time of the warm steps: the
    ``median`` over every replayed step after the first (the first pays one-time costs:
    allocations, a compiled kernel's first call; 85 ms against 0.3 ms for CLT-k) and its
    ``spread``, interquartile range / median. With one step, that step."""
    records = totals(records)
    first = records.groupby(KEYS, sort=False, dropna=False)["step"].transform("first")
    several = records.groupby(KEYS, sort=False, dropna=False)["step"].transform("count") > 1
    warm = records[(records["step"] != first) | ~several]
    seconds = warm.groupby(KEYS, sort=False, dropna=False)["compress_seconds"]
    median = seconds.median()
    spread = (seconds.quantile(0.75) - seconds.quantile(0.25)) / median.where(median > 0)
    return pd.DataFrame({"median": median, "spread": spread.fillna(0.0)})


def summarize_replay(records: pd.DataFrame, link: Link, n: int) -> pd.DataFrame:
    """One row per (scope, compressor, ratio): means over steps, the compression time of
    the warm steps (:func:`warm_compress_seconds`: ``compress_seconds`` and its
    ``compress_spread``), the final memory norm, predicted time per step (communication +
    compression) and the speed-up over the dense fp32 ring all-reduce of the same scope
    on ``n`` learners."""
    records = totals(records)
    grouped = records.groupby(KEYS, sort=False, dropna=False)
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
    extra = {
        column: grouped[column].first() for column in ("memory", "granularity") if column in records
    }
    summary = means.assign(
        compress_seconds=warm["median"],
        compress_spread=warm["spread"],
        memory_norm=grouped["memory_norm"].last(),
        steps=grouped["step"].count(),
        collective=grouped["collective"].first(),
        numel=grouped["numel"].first(),
        **extra,
    ).reset_index()
    summary["seconds"] = summary["comm_seconds"] + summary["compress_seconds"]
    dense = summary["numel"].map(lambda d: dense_seconds(int(d), n, link))
    summary["speedup"] = dense / summary["seconds"]
    return summary
