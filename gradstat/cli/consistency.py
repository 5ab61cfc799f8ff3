"""``gradstat consistency``: how much the learners' gradients agree, step by step
(cosines, dispersions, gradient diversity; docs/methods.md 8)."""

from __future__ import annotations

import pandas as pd

from gradstat.analysis.consistency import ConsistencyParams, consistency
from gradstat.analysis.selection import Selection
from gradstat.cli.noise import STEPS_SHOWN
from gradstat.cli.options import (
    DPI,
    Capture,
    Csv,
    Detail,
    Device,
    Dpi,
    Jobs,
    Json,
    Learners,
    MaybeCompressors,
    Memory,
    Plot,
    Ratios,
    Scope,
    Seed,
    Steps,
    compute_options,
)
from gradstat.cli.output import Output, Result, View, note_sample, progress, show
from gradstat.defaults import ratios_text
from gradstat.store import open_capture

#: Learners up to which the cosine matrix is part of the default output.
MATRIX_SHOWN = 8
#: The defaults are the analysis's, declared once in its parameters.
DEFAULT = ConsistencyParams()
RATIOS = ratios_text(DEFAULT.ratios)


def consistency_command(
    capture: Capture,
    compressors: MaybeCompressors = None,
    ratios: Ratios = RATIOS,
    scope: Scope = "model",
    steps: Steps = None,
    learners: Learners = None,
    seed: Seed = DEFAULT.seed,
    as_json: Json = False,
    csv: Csv = None,
    detail: Detail = False,
    plot: Plot = None,
    dpi: Dpi = DPI,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """How much the learners' gradients agree, step by step.

    Per step: the learners' pairwise cosines (mean, lowest; the matrix with --detail),
    the coefficient of variation of their gradient norms and of their losses, and
    gradient diversity sum ||g_i||^2 / ||sum g_i||^2 (1/n for identical learners). With
    --compressors, Spearman's rank correlation over steps between each of these and
    each compressor's error on the learners' gradients.

    Example: gradstat consistency captures/lm --compressors topk --plot consistency.png
    """
    with open_capture(capture) as cap:
        note_sample(cap)
        result = consistency(
            cap,
            Selection.of(cap, steps, learners, scope),
            ConsistencyParams(compressors, ratios, seed),
            compute=compute_options(device, memory, jobs),
            progress=lambda units: progress(units, "consistency"),
        )
    shown = consistency_result(result.steps, result.pairs, result.correlations)
    shown.document["compressors"] = result.compressors.to_dict(orient="records")
    shown.figure = lambda: _plot(result.steps, result.pairs)
    show(shown, Output(as_json, csv, detail, plot, dpi))


def consistency_result(
    steps: pd.DataFrame, pairs: pd.DataFrame, correlations: pd.DataFrame
) -> Result:
    """The consistency tables: the cosine matrix (in the summary up to ``MATRIX_SHOWN``
    learners), the summary per scope, the correlations with compressors' errors, the
    per-step table (in the summary while short), the answer."""
    from gradstat.analysis.consistency import consistency_summary
    from gradstat.report.answers import consistency_answer

    summary = consistency_summary(steps)
    matrix = _matrix_view(pairs)
    per_step = _per_step_view(steps)
    short = steps["scope"].nunique() == 1 and len(steps) <= STEPS_SHOWN
    small = len(matrix.rows) <= MATRIX_SHOWN
    shown = [*([matrix] if small else []), *([per_step] if short else []), _summary_view(summary)]
    if len(correlations):
        shown.append(_correlation_view(correlations))
    return Result(
        steps,
        summary=shown,
        answer=consistency_answer(summary, correlations),
        detail=[*([] if small else [matrix]), *([] if short else [per_step])],
        document={
            "records": steps.to_dict(orient="records"),
            "pairs": pairs.to_dict(orient="records"),
            "summary": summary.to_dict(orient="records"),
            "correlations": correlations.to_dict(orient="records"),
        },
    )


def _matrix_view(pairs: pd.DataFrame) -> View:
    from gradstat.analysis.consistency import cosine_matrix

    table = cosine_matrix(pairs).reset_index(names="learner")
    table.columns = [str(c) for c in table.columns]
    table["learner"] = table["learner"].astype(str)
    return View(
        f"mean cosine of the learners' gradients over {pairs['step'].nunique()} steps", table
    )


def _summary_view(summary: pd.DataFrame) -> View:
    steps, n = int(summary["steps"].max()), int(summary["learners"].iloc[0])
    return View(
        f"learner consistency over {steps} steps ({n} learners)",
        summary,
        {
            "scope": "scope",
            "cosine_mean": "cosine",
            "cosine_min": "lowest",
            "cosine_first": "first",
            "cosine_last": "last",
            "norm_cv": "norm CV",
            "loss_cv": "loss CV",
            "diversity": "diversity",
        },
        "cosine: mean over pairs and steps; first/last: its mean at the first and last "
        "step; CV: std / mean over learners; diversity = sum ||g_i||^2 / ||sum g_i||^2 "
        "(1/n for identical learners, about 1 for unrelated ones).",
    )


def _per_step_view(steps: pd.DataFrame) -> View:
    return View(
        "learner consistency per step",
        steps,
        {
            "step": "step",
            "scope": "scope",
            "cosine_mean": "cosine",
            "cosine_min": "lowest",
            "norm_cv": "norm CV",
            "loss_mean": "loss",
            "loss_cv": "loss CV",
            "diversity": "diversity",
        },
    )


#: Short headers of the correlation table's measures.
MEASURE_HEADERS = {
    "cosine_mean": "cosine",
    "cosine_min": "lowest",
    "norm_cv": "norm CV",
    "loss_cv": "loss CV",
    "diversity": "diversity",
}


def _correlation_view(correlations: pd.DataFrame) -> View:
    """Spearman's rho per compressor (rows) and measure (columns)."""
    label = [
        name if ratio != ratio else f"{name} {ratio:g}"
        for name, ratio in zip(correlations["compressor"], correlations["ratio"], strict=True)
    ]
    named = correlations.assign(compressor=label)
    keys = ["scope", "compressor"] if named["scope"].nunique() > 1 else ["compressor"]
    wide = named.pivot_table(index=keys, columns="measure", values="rho", sort=False, dropna=False)
    wide = wide.reindex(columns=list(MEASURE_HEADERS)).rename(columns=MEASURE_HEADERS)
    wide = wide.reset_index()
    wide.columns = [str(c) for c in wide.columns]
    steps = int(correlations["steps"].max())
    return View(
        f"Spearman rho over {steps} steps: each compressor's error vs each measure",
        wide,
        note="rho > 0: the relative error ||C(g_i) - g_i||^2 / ||g_i||^2 grows with the "
        "measure; -: a constant series or under 3 steps. p-values: --json or --csv.",
    )


def _plot(steps: pd.DataFrame, pairs: pd.DataFrame):
    from gradstat.plots.consistency import plot_consistency

    return plot_consistency(steps, pairs)
