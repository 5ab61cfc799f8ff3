"""``gradstat noise``: the gradient noise scale B_simple and compression error against
the sampling noise (McCandlish et al. 2018, Appendix A; docs/methods.md 8)."""

from __future__ import annotations

from typing import Annotated

import pandas as pd
import typer

from gradstat.analysis.noise import NoiseParams, noise
from gradstat.analysis.selection import Selection
from gradstat.cli.options import (
    DPI,
    Capture,
    Csv,
    Detail,
    Device,
    Dpi,
    Jobs,
    Json,
    LearnerBatch,
    Learners,
    MaybeCompressors,
    Memory,
    Plot,
    Ratios,
    Scope,
    Seed,
    Steps,
    between,
    compute_options,
)
from gradstat.cli.output import Output, Result, View, note_sample, progress, show
from gradstat.defaults import ratios_text
from gradstat.store import open_capture

Window = Annotated[
    int,
    typer.Option(
        "--window",
        metavar="N",
        callback=between(1),
        help="Steps of the moving averages whose ratio is B_simple over steps.",
    ),
]
Resamples = Annotated[
    int,
    typer.Option(
        "--resamples",
        metavar="N",
        callback=between(100),
        help="Bootstrap resamples of the learners for each interval, 100 or more.",
    ),
]
Confidence = Annotated[
    float, typer.Option("--confidence", metavar="P", help="Level of the intervals, in (0, 1).")
]
#: Steps of a per-step table shown in the summary before it moves to --detail.
STEPS_SHOWN = 12
#: The defaults are the analysis's, declared once in its parameters.
DEFAULT = NoiseParams()
RATIOS = ratios_text(DEFAULT.ratios)


def noise_command(
    capture: Capture,
    batch_size: LearnerBatch = None,
    compressors: MaybeCompressors = None,
    ratios: Ratios = RATIOS,
    scope: Scope = "model",
    steps: Steps = None,
    learners: Learners = None,
    window: Window = DEFAULT.window,
    resamples: Resamples = DEFAULT.resamples,
    confidence: Confidence = DEFAULT.confidence,
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
    """The gradient noise scale B_simple, and compression error against the noise.

    From the learners' gradients (batch b each) and their mean (batch n b): the
    unbiased |G|^2 and tr(Sigma) and B_simple = tr(Sigma) / |G|^2 per step, with a
    bootstrap interval over learners, and the ratio of moving averages over steps
    (McCandlish et al. 2018). With --compressors, each compressor's error on each
    learner's gradient against its sampling noise tr(Sigma) / b: below 1 the error is
    within the gradient's own noise.

    Example: gradstat noise captures/lm --compressors topk,fp16 --plot noise.png
    """
    params = NoiseParams(batch_size, compressors, ratios, window, resamples, confidence, seed)
    with open_capture(capture) as cap:
        note_sample(cap)
        result = noise(
            cap,
            Selection.of(cap, steps, learners, scope),
            params,
            compute=compute_options(device, memory, jobs),
            progress=lambda units: progress(units, "noise"),
        )
    shown = noise_result(result.steps, result.compressors)
    shown.figure = lambda: _plot(result.steps, result.compressors)
    show(shown, Output(as_json, csv, detail, plot, dpi))


def noise_result(steps: pd.DataFrame, compressors: pd.DataFrame) -> Result:
    """The noise tables: the summary per scope (and per compressor), the per-step table
    (in the summary while it is short and has one scope), the answer."""
    from gradstat.analysis.noise import compressor_summary, noise_summary
    from gradstat.report.answers import noise_answer

    summary = noise_summary(steps)
    per_compressor = compressor_summary(compressors) if len(compressors) else compressors
    views = [_summary_view(summary)]
    if len(per_compressor):
        views.append(_compressor_view(per_compressor))
    per_step = [_per_step_view(steps)]
    if len(compressors):
        per_step.append(View("each compressor per step", compressors))
    short = steps["scope"].nunique() == 1 and len(steps) <= STEPS_SHOWN
    return Result(
        steps,
        summary=[*(per_step[:1] if short else []), *views],
        answer=noise_answer(summary, per_compressor),
        detail=per_step[1:] if short else per_step,
        document={
            "records": steps.to_dict(orient="records"),
            "compressors": compressors.to_dict(orient="records"),
            "summary": summary.to_dict(orient="records"),
            "compressor_summary": per_compressor.to_dict(orient="records"),
        },
    )


def _summary_view(summary: pd.DataFrame) -> View:
    steps, n, b = (int(summary[c].max()) for c in ("steps", "learners", "batch_size"))
    return View(
        f"noise scale over {steps} steps ({n} learners x batch {b}): B_simple = mean "
        "tr(Sigma) / mean |G|^2",
        summary,
        {
            "scope": "scope",
            "g2": "|G|^2",
            "trace": "tr(Sigma)",
            "b_simple": "B_simple",
            "step_median": "median",
            "ci_low": "ci low",
            "ci_high": "ci high",
        },
        "median: of the steps' B_simple; ci low/high: median of the steps' bootstrap "
        "intervals over learners.",
    )


def _compressor_view(summary: pd.DataFrame) -> View:
    return View(
        "compression error against the sampling noise tr(Sigma) / b",
        summary,
        {
            "scope": "scope",
            "compressor": "compressor",
            "ratio": "ratio",
            "rel_error": "rel error",
            "noise_ratio": "x noise",
            "noise_ratio_max": "max",
            "within_noise": "within",
        },
        "x noise = mean_i ||C(g_i) - g_i||^2 / (tr(Sigma) / b), mean over steps (below 1: "
        "within the gradient's own noise); max: the worst learner and step; within: the "
        "share of steps where it is below 1 (1 = every step).",
    )


def _per_step_view(steps: pd.DataFrame) -> View:
    return View(
        "noise scale per step (bootstrap interval over learners)",
        steps,
        {
            "step": "step",
            "scope": "scope",
            "g2": "|G|^2",
            "trace": "tr(Sigma)",
            "b_simple": "B_simple",
            "ci_low": "ci low",
            "ci_high": "ci high",
            "b_simple_avg": "moving",
        },
        "moving: sum of tr(Sigma) over sum of |G|^2 of the last --window steps.",
    )


def _plot(steps: pd.DataFrame, compressors: pd.DataFrame):
    from gradstat.plots.noise import plot_noise

    return plot_noise(steps, compressors)
