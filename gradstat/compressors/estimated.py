"""Sparsifiers that pick a threshold instead of sorting: SIDCo, DGC, Gaussian-k, RedSync
and a hard threshold.

Each learner estimates a threshold ``eta`` on its corrected vector with
:func:`gradstat.stats.thresholds.estimate_threshold` (docs/methods.md 2) and sends every
element the threshold selects (``|p| > eta``; ``>=`` for exact and hard thresholds) as
``(int32 index, value)`` pairs, all-gathered; the count varies around ``k`` (the quality
``q = selected / k``). Sources and parameters: docs/replay.md's table. SIDCo with
``stages=0`` adapts each learner's stage count (:class:`~gradstat.stats.sidco.
AdaptiveStages`); ``threshold`` without a given lambda is calibrated once per message on
learner 0's first step to the exact top-k threshold, broadcast, then kept. Random draws
(DGC's sample) are seeded from (``--seed``, step, learner, message).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradstat.compressors.base import Compressor, Exchange
from gradstat.compressors.exchange import Broadcast, Call, Tensors
from gradstat.compressors.memory import DGCMemory, Memory, ResidualMemory
from gradstat.compressors.topk import Sparsifier, sparse_payload
from gradstat.compressors.work import Ops, Work, passes, scatter
from gradstat.stats.passes import RowPasses
from gradstat.stats.sidco import STAGE_FITS, ZEROS, AdaptiveStages
from gradstat.stats.thresholds import ESTIMATORS, estimate_threshold
from gradstat.stats.topk_sets import indices_above

#: Stage count adaptive SIDCo starts from (estimate_threshold's default).
ADAPTIVE_START = 3

#: (float32 passes, comparisons, compactions) of each threshold estimator
#: (gradstat/stats/thresholds.py, chunked): |x| is 2 passes, a reduction 1, a count 2
#: passes + 1 comparison, an exceedance 2 passes + 1 comparison + 1 compaction; then the
#: compressor's mask |p| > eta (2 passes + 1 comparison) and nonzero (1 compaction).
ESTIMATOR_OPS = {
    "sidco-exp": (6 + 2 + 2, 1 + 1 + 1, 1 + 1),
    "sidco-gpd": (6 + 2 + 2, 1 + 1 + 1, 1 + 1),
    "sidco-gamma-gpd": (11 + 2 + 2, 1 + 1 + 1, 1 + 1),
    "dgc": (3 + 2 + 2, 1 + 1, 1 + 1),
    "gaussiank": (4 + 3 + 2 * 2 + 2, 2 + 1, 1),
    "redsync": (3 + 4 + 2 + 4 * 2 + 2 + 2, 1 + 4 + 1 + 1, 1 + 1),
    # RedSync's search seeded by a SIDCo estimate: taken as RedSync's (not calibrated)
    "redsync-sidco": (3 + 4 + 2 + 4 * 2 + 2 + 2, 1 + 4 + 1 + 1, 1 + 1),
    "hard": (2 + 2, 1 + 1, 1),
}


class EstimatedSparsifier(Sparsifier):
    """Send ``|p| > eta`` with ``eta`` from a threshold estimator (see the module docstring).

    ``stages=0`` makes the SIDCo stage count adaptive (per learner and message: each has
    its own object).
    """

    def __init__(
        self,
        ratio: float,
        k: int,
        numel: int,
        estimator: str,
        *,
        stages: int = 0,
        threshold: float | None = None,
        zeros: str = "exclude",
        stage_fit: str = "moments",
        momentum: float = 0.9,
    ) -> None:
        self.name = "threshold" if estimator == "hard" else estimator
        self.ratio = ratio
        self.k = k
        self.estimator = estimator
        self.stages = stages
        self.zeros = zeros
        self.stage_fit = stage_fit
        self.momentum = momentum
        self.generator = torch.Generator()
        self.adaptive = AdaptiveStages(initial=ADAPTIVE_START) if not stages else None
        self.numel = numel
        #: The hard threshold: given, or calibrated (None before the first step).
        self.threshold = threshold
        self.nonzeros: int | None = None

    def exchange(self, p: torch.Tensor, call: Call) -> Exchange:
        """The generic exchange, with this call's seed and the memory's count of
        non-zeros; a hard threshold not given is first calibrated on learner 0 and
        broadcast."""
        if self.estimator == "hard" and self.threshold is None:
            value = torch.zeros(1, dtype=torch.float64)
            if call.learner == 0:
                value[0] = estimate_threshold(p.reshape(-1), self.ratio, "topk").threshold
            value = yield Broadcast(value, 0)
            self.threshold = float(value[0])
        self.generator = call.generator()
        self.nonzeros = call.facts.get("nonzeros")
        return (yield from super().exchange(p, call))

    def compress(self, tensor: torch.Tensor, name: str) -> tuple[Tensors, Any]:
        """The context is ``(numel, {"threshold": eta, "stages": stages})``."""
        tensor = tensor.reshape(-1)
        nonzeros, self.nonzeros = self.nonzeros, None
        shared = None if nonzeros is None else RowPasses(tensor, nonzeros=nonzeros)
        if self.estimator == "hard":
            result = estimate_threshold(tensor, self.ratio, "hard", threshold=self.threshold)
        else:
            result = estimate_threshold(
                tensor,
                self.ratio,
                self.estimator,
                stages=self.stages or self.adaptive.stages,
                generator=self.generator,
                zeros=self.zeros,
                stage_fit=self.stage_fit,
                shared=shared,
            )
        indices = indices_above(tensor.reshape(-1), result.threshold, result.inclusive)
        if self.adaptive is not None:
            self.adaptive.update(indices.numel() / self.k)
        info = {"threshold": float(result.threshold), "stages": float(result.stages)}
        return sparse_payload(tensor, indices), (tensor.numel(), info)

    def numel_of(self, ctx: Any) -> int:
        return ctx[0]

    def describe(self, ctx: Any) -> dict[str, float]:
        return ctx[1]

    def memory(self) -> Memory:
        return DGCMemory(self.momentum) if self.estimator == "dgc" else ResidualMemory()

    def settings(self) -> dict[str, float]:
        settings: dict[str, float] = {"k": self.k}
        if ESTIMATORS[self.estimator].staged:
            settings["stages"] = self.stages or self.adaptive.stages
            settings["adaptive"] = float(not self.stages)
        if self.estimator == "hard" and self.threshold is not None:
            settings["threshold"] = self.threshold
        if self.estimator == "dgc":
            settings["sample_rate"] = self._sample() / self.numel
        return settings

    def _sample(self) -> int:
        """DGC's sample size: ``max(1%, 2 / ratio)`` of the coordinates."""
        d = self.numel
        return min(d, max(math.ceil(0.01 * d), math.ceil(2.0 / self.ratio)))

    def work(self, numel: int, memory: Memory) -> Work:
        d, k = numel, self.k
        count, compare, compact = ESTIMATOR_OPS[self.estimator]
        local = (
            memory.work(d) + passes(count, d, 20) + Ops(compare=compare * d, compact=compact * d)
        )
        if self.estimator == "dgc":
            sample = self._sample()
            local += Ops(random=sample, topk_in=sample, topk_out=sample * self.ratio)
        local += passes(1, d)  # a dense zero vector
        return Work(local, Ops(), scatter(k), "all")


def build(ctx: Any) -> Compressor:
    """The sparsifier the registry names (``threshold``: the ``hard`` estimator)."""
    assert ctx.ratio is not None and ctx.k is not None
    return EstimatedSparsifier(
        ctx.ratio,
        ctx.k,
        ctx.numel,
        "hard" if ctx.name == "threshold" else ctx.name,
        stages=int(ctx.params.get("stages", 0)),
        threshold=ctx.params.get("threshold") or None,
        zeros=ZEROS[int(ctx.params.get("zeros", 0))],
        stage_fit=STAGE_FITS[int(ctx.params.get("stage_fit", 0))],
        momentum=ctx.params.get("momentum", 0.9),
    )
