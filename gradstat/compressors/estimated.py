"""Sparsifiers that pick a threshold instead of sorting: SIDCo, DGC, Gaussian-k, RedSync
and a hard threshold.

Each learner estimates a threshold ``eta`` on its corrected vector with
:func:`gradstat.stats.thresholds.estimate_threshold` (docs/methods.md 2) and sends every
element the threshold selects (``|p| > eta``; ``>=`` for exact and hard thresholds) as
``(int32 index, value)`` pairs, all-gathered. The count
varies around ``k``: the estimation quality ``q = selected / k`` is recorded.

* SIDCo-E / -P / -GP (Abdelmoniem et al. 2021, arXiv 2101.10761): multi-stage fits of
  exponential / GPD / gamma-then-GPD; with ``stages=0`` (the default) each learner adapts
  its stage count, starting from 3, from its running quality
  (:class:`~gradstat.stats.sidco.AdaptiveStages`); ``zeros`` (exclude/include) and
  ``stage_fit`` (moments/mle) as in :mod:`gradstat.stats.sidco`.
* DGC (Lin et al. 2018): threshold from a sample of ``max(1%, 2/delta)`` coordinates;
  pair it with DGC's momentum correction memory (:class:`~gradstat.compressors.memory.DGCMemory`).
* Gaussian-k (Shi et al. 2019) and RedSync (Fang et al. 2019); ``redsync-sidco`` is
  RedSync as the SIDCo reference runs it (docs/methods.md section 2).
* ``threshold``: a fixed hard threshold ``|p| >= lambda``. Without a given lambda it is
  calibrated once, on learner 0's first replayed step, to the exact top-k threshold at
  the ratio, then kept: the replay shows how the density drifts under a fixed lambda.
"""

from __future__ import annotations

import math

import torch

from gradstat.compressors.legacy import LocalCompressor, Payload, sparse_decompress, sparse_payload
from gradstat.stats.passes import RowPasses
from gradstat.stats.sidco import AdaptiveStages
from gradstat.stats.thresholds import ESTIMATORS, estimate_threshold
from gradstat.stats.topk_sets import indices_above

#: Stage count adaptive SIDCo starts from (estimate_threshold's default).
ADAPTIVE_START = 3


class EstimatedSparsifier(LocalCompressor):
    """Send ``|p| > eta`` with ``eta`` from a threshold estimator (see the module docstring).

    ``stages=0`` makes the SIDCo stage count adaptive per learner.
    """

    collective = "allgather"
    sparse = True

    def __init__(
        self,
        name: str,
        ratio: float,
        k: int,
        numel: int,
        estimator: str,
        *,
        stages: int = 0,
        threshold: float | None = None,
        zeros: str = "exclude",
        stage_fit: str = "moments",
        seed: int = 0,
    ) -> None:
        self.name = name
        self.ratio = ratio
        self.k = k
        self.estimator = estimator
        self.stages = stages
        self.threshold = threshold
        self.zeros = zeros
        self.stage_fit = stage_fit
        self.generator = torch.Generator().manual_seed(seed)
        self.adaptive: dict[int, AdaptiveStages] = {}
        self.numel = numel

    def _stages(self, learner: int) -> int:
        if self.stages:
            return self.stages
        if learner not in self.adaptive:
            self.adaptive[learner] = AdaptiveStages(initial=ADAPTIVE_START)
        return self.adaptive[learner].stages

    def compress(
        self, tensor: torch.Tensor, learner: int = 0, *, nonzeros: int | None = None
    ) -> Payload:
        """``nonzeros``: how many values of ``tensor`` are not zero, when the caller
        already counted them (replay's DGC memories do, while forming the row)."""
        shared = None if nonzeros is None else RowPasses(tensor, nonzeros=nonzeros)
        if self.estimator == "hard":
            if self.threshold is None:
                self.threshold = estimate_threshold(tensor, self.ratio, "topk").threshold
            result = estimate_threshold(tensor, self.ratio, "hard", threshold=self.threshold)
        else:
            result = estimate_threshold(
                tensor,
                self.ratio,
                self.estimator,
                stages=self._stages(learner),
                generator=self.generator,
                zeros=self.zeros,
                stage_fit=self.stage_fit,
                shared=shared,
            )
        indices = indices_above(tensor.reshape(-1), result.threshold, result.inclusive)
        if not self.stages and learner in self.adaptive:
            self.adaptive[learner].update(indices.numel() / self.k)
        info = {"threshold": float(result.threshold), "stages": float(result.stages)}
        return sparse_payload(tensor, indices, info)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return sparse_decompress(payload)

    def settings(self) -> dict[str, float]:
        settings: dict[str, float] = {"k": self.k}
        if ESTIMATORS[self.estimator].staged:
            adaptive = [a.stages for a in self.adaptive.values()]
            settings["stages"] = self.stages or sum(adaptive) / max(1, len(adaptive))
            settings["adaptive"] = float(not self.stages)
        if self.estimator == "hard" and self.threshold is not None:
            settings["threshold"] = self.threshold
        if self.estimator == "dgc":
            sample = min(self.numel, max(math.ceil(0.01 * self.numel), math.ceil(2.0 / self.ratio)))
            settings["sample_rate"] = sample / self.numel
        return settings
