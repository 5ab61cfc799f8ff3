"""The report's sections on the learners: the gradient noise scale and their consistency.

Built like those of :mod:`gradstat.report.sections` (which lists them in
:data:`~gradstat.report.sections.SECTIONS`): each runs its analysis on the whole capture
with the report's compute, draws its figure and returns a :class:`Part`. The noise
section sets the report's compressors that have a per-learner form against the sampling
noise, at the report's smallest ratio; a capture that does not record its batch size
gets the section's reason instead (``gradstat noise --batch-size`` gives it).
"""

from __future__ import annotations

import pandas as pd

from gradstat.analysis.consistency import ConsistencyParams, consistency, consistency_summary
from gradstat.analysis.learner_errors import per_learner_names
from gradstat.analysis.noise import NoiseParams, compressor_summary, noise, noise_summary
from gradstat.plots.consistency import plot_consistency
from gradstat.plots.noise import plot_noise
from gradstat.report import answers
from gradstat.report.context import Part, ReportContext

#: Column names as people read them in the two sections' tables.
HEADERS = {
    "scope": "scope",
    "steps": "steps",
    "learners": "learners n",
    "batch_size": "batch b",
    "g2": "|G|²",
    "trace": "tr(Σ)",
    "noise": "tr(Σ) / b",
    "b_simple": "B_simple",
    "step_median": "median of the steps'",
    "ci_low": "interval low (median)",
    "ci_high": "interval high (median)",
    "learners_at_b": "learners of batch b in B_simple",
    "compressor": "compressor",
    "ratio": "ratio k/d",
    "error": "||C(g_i) − g_i||²",
    "rel_error": "relative error",
    "noise_ratio": "error / noise",
    "noise_ratio_max": "largest",
    "within_noise": "steps within the noise",
    "cosine_mean": "mean cosine",
    "cosine_min": "lowest cosine",
    "cosine_first": "at the first step",
    "cosine_last": "at the last step",
    "norm_cv": "norm CV",
    "loss_cv": "loss CV",
    "diversity": "diversity",
}


def _human(table: pd.DataFrame) -> pd.DataFrame:
    return table.rename(columns={c: HEADERS.get(c, c) for c in table.columns})


def noise_section(ctx: ReportContext) -> Part:
    ratio = min(ctx.settings.ratios)
    names = per_learner_names(ctx.settings.compressors) or None
    result = noise(
        ctx.cap,
        ctx.selection,
        NoiseParams(compressors=names, ratios=(ratio,)),
        compute=ctx.compute,
        progress=ctx.progress("noise"),
    )
    summary = noise_summary(result.steps)
    per_compressor = compressor_summary(result.compressors) if names else result.compressors
    lines = answers.noise_answer(summary, per_compressor)
    reading = (
        "The gradient noise scale B_simple = tr(Σ) / |G|² (McCandlish et al. 2018) is the "
        "batch size at which the gradient's sampling noise equals its signal, estimated "
        "without bias from the learners' gradients (batch b each) and their mean (batch n "
        "b); the interval of each step is a bootstrap over learners. "
        + " ".join(lines)
        + " A compressor's error on one learner's gradient below the sampling noise "
        "tr(Σ) / b adds less variance than that learner's own batch does."
    )
    tables = [("noise scale over steps", _human(summary))]
    if len(per_compressor):
        tables.append(
            (f"compression error against the noise, ratio {ratio:g}", _human(per_compressor))
        )
    figure = plot_noise(result.steps, result.compressors)
    return Part(reading, [figure], tables, lines[:2])


def consistency_section(ctx: ReportContext) -> Part:
    result = consistency(
        ctx.cap,
        ctx.selection,
        ConsistencyParams(),
        compute=ctx.compute,
        progress=ctx.progress("consistency"),
    )
    summary = consistency_summary(result.steps)
    lines = answers.consistency_answer(summary)
    reading = (
        "How much the learners' gradients agree at each step: their pairwise cosines, "
        "the spread of their gradient norms and losses (coefficient of variation), and "
        "gradient diversity Σ||g_i||² / ||Σ g_i||² (Yin et al. 2018). ScaleCom's "
        "guarantees assume similar learners; dispersion that drifts while the mean loss "
        "looks smooth is the warning sign of arXiv 2602.14462. " + " ".join(lines)
    )
    figure = plot_consistency(result.steps, result.pairs)
    return Part(reading, [figure], [("consistency over steps", _human(summary))], lines[:1])
