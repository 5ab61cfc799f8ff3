"""Defaults shared by the command line and the report, declared once.

The command-line options (``gradstat.cli.options``) and :class:`ReportSettings` take
their defaults from here, so ``gradstat replay`` and the report's replay section start
from the same ratios, link and figure resolution.
"""

from __future__ import annotations

#: Densities k/d of fit, build-up, replay and the report.
RATIOS = (0.01, 0.001)
#: Densities of similarity and overlap (one top-k set per learner, step and ratio).
SET_RATIOS = (0.001,)
BANDWIDTH = "10Gbit/s"
LATENCY = "5us"
#: Resolution of ``--plot`` figures and of the report's embedded figures.
DPI = 150
REPORT_DPI = 110
#: Threshold estimators ``gradstat fit`` runs (``hard`` needs a threshold;
#: ``redsync-sidco`` is a reference behaviour, run on request).
FIT_ESTIMATORS = (
    "topk",
    "sidco-exp",
    "sidco-gpd",
    "sidco-gamma-gpd",
    "dgc",
    "gaussiank",
    "redsync",
)
#: Compressors ``gradstat replay`` runs.
REPLAYED = "topk,dgc,sidco-gpd,clt-k,powersgd"
#: Compressors of the report's replay and recommendation: the replayed ones and the two
#: 16-bit casts (the dense baselines a sparsifier must beat).
REPORT_COMPRESSORS = "fp16,bf16," + REPLAYED
ERROR_BUDGET = 0.5
RANK = 4
BETA = 1.0
SEED = 0
THREADS = 1
#: Relative gap between predicted and measured error that counts as divergence (compare).
DIVERGENCE_TOLERANCE = 0.25


def ratios_text(ratios) -> str:
    """``(0.01, 0.001)`` as the option text ``0.01,0.001``."""
    return ",".join(f"{r:g}" for r in ratios)
