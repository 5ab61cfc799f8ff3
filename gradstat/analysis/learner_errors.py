"""Each learner's own compression error ``||C(g_i) - g_i||^2`` at a step, per compressor.

What ``noise --compressors`` sets against the sampling noise and ``consistency
--compressors`` correlates with the learners' agreement: the error a compressor makes on
one learner's raw gradient, without error feedback (a replay's errors include the
memories of earlier steps; docs/noise.md). ``C(g_i)`` comes from ONE adapter,
:func:`compressed`: the learner's compressor object (``Scheme.compressor``) compresses
and decompresses the row through the public GRACE protocol
(:mod:`gradstat.compressors.base`). Compressors without a per-learner form (CLT-k,
gTop-k, PowerSGD exchange across learners within the step) are refused when planned.

Each learner's scope row is read whole (a compressor sees the whole scope), one learner
at a time: a second pass over the step's rows, besides the Gram's.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gradstat.analysis.compute import Compute
from gradstat.analysis.replay import scope_layers
from gradstat.analysis.row_workspace import read_block
from gradstat.compressors.base import Compressor
from gradstat.compressors.plan import build_plan
from gradstat.compressors.registry import CompressorSpec, Scheme, build_scheme
from gradstat.compressors.spec import parse_compressors
from gradstat.errors import GradstatWarning, UsageError
from gradstat.stats.rows import require_finite
from gradstat.store import Capture, Scope, layer_table


def compressed(scheme: Scheme, learner: int, row: torch.Tensor, name: str) -> torch.Tensor:
    """``C(g)`` of learner ``learner``'s row ``row`` of scope ``name``: its compressor's
    ``compress`` then ``decompress`` (the one place the compressor API is used here)."""
    compressor = scheme.compressor(learner, 0)
    tensors, ctx = compressor.compress(row, name)
    return compressor.decompress(tensors, ctx)


def per_learner(scheme: Scheme) -> bool:
    """Whether ``scheme``'s compressor compresses one learner's row on its own (has a
    ``compress`` of its own)."""
    return type(scheme.compressor(0, 0)).compress is not Compressor.compress


@dataclass(frozen=True)
class Config:
    """One compressor at one ratio (None: a fixed-rate one) on one scope."""

    scope: int
    spec: CompressorSpec
    ratio: float | None

    @property
    def label(self) -> str:
        return self.spec.label


def plan_configs(
    cap: Capture, scopes: Sequence[Scope], compressors: str, ratios: Sequence[float], seed: int
) -> list[Config]:
    """Every (scope, compressor, ratio) that can run: ``UsageError`` for a compressor
    without a per-learner form, or one that cannot honour a ratio on the only scope;
    with several scopes those are skipped with one warning."""
    configs, skipped = [], []
    for spec in parse_compressors(compressors):
        for k, sc in enumerate(scopes):
            for ratio in [None] if spec.fixed_rate else ratios:
                try:
                    scheme = build(cap, sc, spec, ratio, seed)
                except UsageError as exc:
                    if len(scopes) == 1:
                        raise
                    skipped.append(f"{sc.name}: {exc}")
                    continue
                if not per_learner(scheme):
                    raise UsageError(
                        f"{spec.label} compresses with every learner at once (it has no "
                        "per-learner compress/decompress), so it has no error of one "
                        "learner's gradient; compare topk, dgc, sidco-*, fp16 and the "
                        "other per-learner compressors"
                    )
                configs.append(Config(k, spec, ratio))
    if skipped:
        warnings.warn(
            f"skipped {len(skipped)} (scope, compressor, ratio) combination(s) that cannot "
            f"run, e.g. {skipped[0]}",
            GradstatWarning,
            stacklevel=3,
        )
    return configs


def unit_configs(
    cap: Capture,
    scopes: Sequence[Scope],
    compressors: str | None,
    ratios: Sequence[float],
    seed: int,
) -> list[Config]:
    """:func:`plan_configs` again inside a unit, quietly (the analysis warned when it
    planned them); none without ``compressors``."""
    if not compressors:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GradstatWarning)
        return plan_configs(cap, scopes, compressors, ratios, seed)


def build(cap: Capture, sc: Scope, spec: CompressorSpec, ratio: float | None, seed: int) -> Scheme:
    """``spec``'s scheme at ``ratio`` for scope ``sc``: one message, the whole scope
    (``--granularity model``), as one learner's gradient is compared with its ``C(g)``."""
    return build_scheme(spec, ratio, build_plan(scope_layers(cap.layers, sc)), seed=seed)


def learner_errors(
    cap: Capture,
    step: int,
    learners: Sequence[int],
    scopes: Sequence[Scope],
    configs: Sequence[Config],
    compute: Compute,
    seed: int,
    what: str,
) -> list[dict]:
    """One record per config: ``scope``, ``compressor``, ``ratio`` (NaN for fixed-rate
    ones), ``errors`` (``||C(g_i) - g_i||^2`` per learner, float64) and ``norms2``
    (``||g_i||^2``). Schemes are built afresh for the step (no state carried between
    steps, so every unit computes alike)."""
    device = compute.torch_device()
    schemes = [build(cap, scopes[c.scope], c.spec, c.ratio, seed) for c in configs]
    errors = np.zeros((len(configs), len(learners)))
    norms2 = np.zeros((len(configs), len(learners)))
    for k, sc in enumerate(scopes):
        mine = [i for i, c in enumerate(configs) if c.scope == k]
        if not mine:
            continue
        row = np.empty(sc.numel, dtype=np.float32)
        for j, learner in enumerate(learners):
            g = torch.from_numpy(read_block(cap, step, learner, sc, 0, sc.numel, row)).to(device)
            require_finite(step, g, [learner], what)
            norm2 = float(g.double().square().sum())
            for i in mine:
                difference = compressed(schemes[i], j, g.clone(), sc.name).to(g.device) - g
                errors[i, j] = float(difference.double().square().sum())
                norms2[i, j] = norm2
    return [
        {
            "scope": scopes[c.scope].name,
            "compressor": c.label,
            "ratio": math.nan if c.ratio is None else c.ratio,
            "errors": errors[i],
            "norms2": norms2[i],
        }
        for i, c in enumerate(configs)
    ]


def per_learner_names(compressors: str) -> str:
    """The names of ``compressors`` (comma-separated) that compress one learner's row on
    their own, comma-separated ("" when none does): what the report sets against the
    noise, from its list of replayed compressors (each tried on a scope of 64 values)."""
    kept = []
    for spec in parse_compressors(compressors):
        ratio = None if spec.fixed_rate else 0.5
        try:
            scheme = build_scheme(spec, ratio, build_plan(layer_table([("x", (64,))])))
        except UsageError:
            continue
        if per_learner(scheme):
            kept.append(spec.label)
    return ",".join(kept)
