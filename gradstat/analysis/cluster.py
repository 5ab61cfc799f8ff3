"""From the capture's learners to the user's cluster: build-up beyond n and compute time.

Build-up B(m) = E[U(m)] / k of an all-gather of m learners' sparse sets is measured
exactly for m = 1..n (the capture's learners) from the multiplicity histogram the replay
records per step (:func:`gradstat.stats.topk_sets.buildup_curve`, hypergeometric average
over every m-subset). Beyond n it is extrapolated with a stated model: a power law
``B(m) = B(1) m^b``, ``b`` fitted by least squares in log-log over the measured
m = 2..n, capped by ``min(B(1) m, d / k)`` (the union cannot exceed m sets nor d).
b = 1 means disjoint sets (build-up grows linearly), b = 0 identical ones. With n = 2 the
fit rests on one point: say so when reading it.

Build-up sets the size of the all-gathered aggregate at the cluster size: ``B(N) k``
non-zeros (the dense update's density ``B(N) k / d``), and every learner receives the N
payloads, ``N x bytes``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
import torch

from gradstat.stats.topk_sets import buildup_curve


@dataclass(frozen=True)
class BuildupModel:
    """Measured B(m), m = 1..n, the fitted exponent and the extrapolation at ``cluster``."""

    measured: list[float]
    exponent: float
    cluster: int
    at_cluster: float
    cap: float

    def at(self, m: int) -> float:
        """B(m): measured for m <= n, else the capped power law."""
        if m <= len(self.measured):
            return self.measured[m - 1]
        first = self.measured[0]
        return min(first * float(m) ** self.exponent, first * m, self.cap)

    def to_dict(self) -> dict:
        return {
            "model": "B(m) = B(1) m^b, least squares in log-log over measured m = 2..n, "
            "capped at min(B(1) m, d/k)",
            "measured": self.measured,
            "exponent": self.exponent,
            "cluster_size": self.cluster,
            "at_cluster": self.at_cluster,
        }


def fit_exponent(curve: np.ndarray) -> float:
    """b of B(m) = B(1) m^b: sum(log m log(B/B(1))) / sum(log^2 m) over m >= 2."""
    m = np.arange(2, len(curve) + 1, dtype=np.float64)
    if m.size == 0 or not curve[0] > 0:
        return math.nan
    log_b = np.log(np.maximum(curve[1:] / curve[0], 1.0))
    return float(np.sum(np.log(m) * log_b) / np.sum(np.log(m) ** 2))


def buildup_model(records: pd.DataFrame, cluster: int) -> BuildupModel | None:
    """The build-up of one (compressor, ratio) from its replay records, or ``None`` when
    it is not an all-gather of sparse sets (no ``multiplicity`` recorded)."""
    hists = [h for h in records["multiplicity"] if isinstance(h, list) and h]
    if not hists:
        return None
    n = len(hists[0])
    k = float(records["k"].iloc[0])
    d = float(records["numel"].iloc[0])
    curves = [buildup_curve(torch.tensor(h), n).numpy() / k for h in hists]
    curve = np.mean(curves, axis=0)
    exponent = fit_exponent(curve) if n > 1 else math.nan
    model = BuildupModel(
        measured=[float(b) for b in curve],
        exponent=exponent,
        cluster=cluster,
        at_cluster=math.nan,
        cap=d / k,
    )
    if cluster <= n or math.isfinite(exponent):
        return replace(model, at_cluster=model.at(cluster))
    return model
