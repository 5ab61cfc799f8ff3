"""Defaults shared by the analyses' parameters, the command line and the report,
declared once.

The analyses' parameters (``FitParams``, ``SimilarityParams``, ...), the command-line
options (``gradstat.cli.options``) and :class:`ReportSettings` take their defaults from
here (a module without torch, which ``--help`` reads), so ``gradstat fit``,
``gradstat.fit`` and the report's fit section start from the same values.
"""

from __future__ import annotations

#: Densities k/d of fit, build-up, replay and the report.
RATIOS = (0.01, 0.001)
#: Densities of similarity and overlap (one top-k set per learner, step and ratio).
SET_RATIOS = (0.001,)
#: ``overlap`` compares each selected step with the one this many selected steps on.
LAG = 1
#: The vectors whose top-k sets similarity, build-up and overlap take: the recorded
#: gradients (``raw``) or the error-feedback-corrected ones (``ef``).
ON = "raw"
#: ``fit``: the distributions, their method, SIDCo's stage counts, the subsample of MLE
#: fits and their scores, and how SIDCo and Gaussian-k treat exact zeros and later stages.
FIT_DISTS = ("gpd",)
FIT_METHOD = "moments"
FIT_STAGES = (1, 2, 3)
FIT_SAMPLE = 1_000_000
ZEROS = "exclude"
STAGE_FIT = "moments"
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
