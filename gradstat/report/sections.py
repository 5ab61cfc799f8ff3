"""The sections of ``gradstat report``, in page order (:data:`SECTIONS`: key, title,
build). Each build runs its analysis through the shared :class:`ReportContext`, draws
figures with the library's plot functions and returns a :class:`Part`: the reading of
what the numbers show, figures, tables under human column names (:data:`HEADERS`), and
its line for the summary box at the top.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from gradstat.analysis.buildup import BuildupParams, buildup, buildup_summary
from gradstat.analysis.fit import (
    FitParams,
    fit,
    magnitude_sample,
    quality_summary,
    rank_distributions,
)
from gradstat.analysis.overlap import OverlapParams, overlap, overlap_summary
from gradstat.analysis.selection import Selection
from gradstat.analysis.similarity import SimilarityParams, similarity, similarity_summary
from gradstat.formatting import counted
from gradstat.plots.capture import plot_loss
from gradstat.plots.fit import plot_fit_at
from gradstat.plots.replay import plot_replay
from gradstat.plots.similarity import plot_buildup, plot_overlap, plot_similarity
from gradstat.report import answers
from gradstat.report.context import Part, ReportContext, SectionSpec
from gradstat.report.learner_sections import consistency_section, noise_section


def _overview(ctx: ReportContext) -> Part:
    cap, steps = ctx.cap, ctx.cap.steps
    facts = pd.DataFrame(
        [
            ("workload", f"{cap.workload} ({cap.meta.get('workload_description', '')})"),
            ("status", cap.status),
            ("learners", f"{cap.learners_text()} ({cap.meta.get('backend')})"),
            (
                "recorded steps",
                f"{len(steps)}" + (f" ({steps[0]}..{steps[-1]})" if len(steps) else ""),
            ),
            ("gradient size", f"{cap.numel:,} values in {len(cap.layers)} layers ({cap.dtype})"),
            ("bytes on disk", f"{cap.describe()['bytes'] / 1e6:.1f} MB"),
            ("command", str(cap.meta.get("command", ""))),
        ],
        columns=["", "value"],
    )
    if cap.status == "complete":
        state = "The capture is complete."
    else:
        last = f"step {steps[-1]}" if len(steps) else "before its first step"
        state = f"The capture was {cap.status} and is read up to {last}, its last committed step."
    recorded = f"; {cap.learners_text()} recorded" if cap.is_sample else ""
    reading = (
        f"{counted(cap.world_size, 'learner')} trained {cap.workload} with real data-parallel "
    )
    reading += f"training{recorded}. {state}"
    figures = []
    if len(steps):
        first, last = np.nanmean(cap.losses[:, 0]), np.nanmean(cap.losses[:, -1])
        reading += (
            f" The learners' mean loss went from {first:.3g} to {last:.3g} over the recorded "
            "steps; each learner's curve is its own batch, so the spread between curves is "
            "the data-parallel noise that makes their gradients differ."
        )
        figures.append(plot_loss(steps, cap.losses, f"{cap.workload}: training loss per learner"))
    return Part(reading, figures, [("capture", facts)])


def _stages_text(quality: pd.DataFrame, estimator: str) -> list[str]:
    """Per ratio, q of ``estimator`` by stage count, and whether more stages bring q
    closer to 1 (said only when they do)."""
    lines = []
    rows = quality[(quality["estimator"] == estimator) & (quality["stages"] != "auto")]
    for ratio, group in rows.groupby("ratio", sort=False):
        group = group.sort_values("stages")
        q = group["q median"].to_numpy()
        by_stage = ", ".join(
            f"{s} stage{'s' if s != '1' else ''}: {v:.3g}"
            for s, v in zip(group["stages"], q, strict=True)
        )
        if len(q) > 1:
            first, last = abs(np.log(q[0])), abs(np.log(q[-1]))
            trend = (
                "more stages bring q closer to 1"
                if last < first
                else "more stages do not bring q closer to 1 here"
            )
            by_stage += f"; {trend}"
        lines.append(f"{estimator} at ratio {ratio:g}, median q by stages: {by_stage}.")
    return lines


def _fit(ctx: ReportContext) -> Part:
    cap, settings = ctx.cap, ctx.settings
    chosen = np.unique(np.linspace(0, len(cap.steps) - 1, settings.fit_steps).round().astype(int))
    steps = ",".join(str(int(cap.steps[i])) for i in chosen) if len(cap.steps) else None
    selection = Selection.of(cap, steps)
    params = FitParams(dists="all", ratios=settings.ratios, sample=200_000)
    records = fit(cap, selection, params, compute=ctx.compute, progress=ctx.progress("fit"))
    ranking, quality = rank_distributions(records), distinct_quality(quality_summary(records))
    stages = _stages_text(quality, "sidco-gpd")
    reading = (
        "Distributions fitted to |g| of the whole model "
        f"({counted(len(selection.steps), 'step')} x "
        f"{counted(len(selection.learners), 'learner')}): {answers.best_fit(ranking)} A threshold "
        "estimator's quality is q = selected / k of the target: q near 1 keeps the intended "
        "number of elements without a sort. "
        + " ".join(stages + answers.closest_estimators(quality))
    )
    step, learner = selection.steps[0], selection.learners[0]
    scope = selection.scopes(cap)[0]
    magnitudes = magnitude_sample(cap, step, learner, scope)
    figure = plot_fit_at(records, magnitudes, step, learner, scope.name, cap.workload)
    return Part(
        reading,
        [figure],
        [
            ("distributions ranked by KS", _human(ranking)),
            (
                "threshold estimators: median q = selected / k (range over records)",
                _by_ratio(quality),
            ),
        ],
        [answers.best_fit(ranking), *answers.closest_estimators(quality, notes=False)[-1:]],
    )


def distinct_quality(quality: pd.DataFrame) -> pd.DataFrame:
    """The estimator table without the rows of a fitted distribution's own quantile
    (``fit:exp``) that repeat an estimator's row (SIDCo-E with one stage is that very
    quantile): one row per distinct answer."""
    keys = ["ratio", "q median", "q min", "q max"]
    fitted = quality["estimator"].str.startswith("fit:")
    seen = set(map(tuple, quality.loc[~fitted, keys].to_numpy().tolist()))
    repeat = [
        f and tuple(row) in seen
        for f, row in zip(fitted, quality[keys].to_numpy().tolist(), strict=True)
    ]
    return quality[~pd.Series(repeat, index=quality.index)]


def _by_ratio(quality: pd.DataFrame) -> pd.DataFrame:
    """One row per (estimator, stages), per ratio its median q and range ``min..max``:
    half the rows of one row per ratio, each estimator's ratios side by side."""
    table = quality[["estimator", "stages"]].drop_duplicates().reset_index(drop=True)
    for ratio, rows in quality.groupby("ratio", sort=False):
        rows = table.merge(rows, on=["estimator", "stages"], how="left")
        table[f"q at {ratio:g}"] = rows["q median"]
        table[f"range at {ratio:g}"] = [
            "" if pd.isna(low) else f"{low:.3g}..{high:.3g}"
            for low, high in zip(rows["q min"], rows["q max"], strict=True)
        ]
    return table


def _similarity(ctx: ReportContext) -> Part:
    ratio = min(ctx.settings.ratios)
    result = similarity(
        ctx.cap,
        ctx.selection,
        SimilarityParams(ratio),
        compute=ctx.compute,
        progress=ctx.progress("similarity"),
    )
    summary = similarity_summary(result.steps)
    row = summary.iloc[0]
    reading = (
        f"At density {ratio:g} (k = {int(row['k'])} of {int(row['d']):,}), two learners' top-k "
        f"sets share {row['mean_overlap']:.1%} of their indices on average "
        f"({row['overlap_vs_random']:.0f}x the {row['random_overlap']:.2%} expected of random "
        f"sets), and a learner's set holds {row['mean_overlap_global']:.1%} of the mean "
        f"gradient's top-k. That similarity is what ScaleCom's CLT-k relies on: one "
        f"leader's indices capture {row['mean_energy']:.1%} of the mean gradient's energy "
        f"against {row['energy_topk']:.1%} for its own top-k."
    )
    return Part(
        reading,
        [plot_similarity(result.pairs)],
        [("summary over steps", _human(summary))],
        answers.similarity_answer(summary),
    )


def _buildup(ctx: ReportContext) -> Part:
    records = buildup(
        ctx.cap,
        ctx.selection,
        BuildupParams(ctx.settings.ratios),
        compute=ctx.compute,
        progress=ctx.progress("buildup"),
    )
    summary = buildup_summary(records)
    reading = (
        "Gradient build-up: " + " ".join(answers.buildup_answer(summary)) + " Build-up below "
        "the random baseline means the learners agree on the important coordinates; it "
        "still grows with the number of learners, which is why all-gathered sparse "
        "gradients stop paying off at scale (a dense all-reduce moves the whole vector once)."
    )
    return Part(
        reading,
        [plot_buildup(records)],
        [("B(m)", _human(summary))],
        answers.buildup_answer(summary)[-1:],
    )


def _overlap(ctx: ReportContext) -> Part:
    ratio = min(ctx.settings.ratios)
    records = overlap(
        ctx.cap,
        ctx.selection,
        OverlapParams(ratio),
        compute=ctx.compute,
        progress=ctx.progress("overlap"),
    )
    summary = overlap_summary(records)
    mean_row = summary[summary["learner"].astype(str) == "mean"].iloc[0]
    reading = (
        f"Between consecutive recorded steps ({_gap(mean_row)} apart): "
        + " ".join(answers.overlap_answer(summary))
        + " High temporal overlap means indices chosen at one step stay good for the next, "
        "which is what index-reuse and error-feedback schemes exploit."
    )
    return Part(
        reading,
        [plot_overlap(records)],
        [("per learner", _human(summary))],
        answers.overlap_answer(summary),
    )


def _replay(ctx: ReportContext) -> Part:
    records, n = ctx.replay[1], ctx.cost_learners
    summary = ctx.priced
    run = ctx.replay[0]
    priced = ctx.recommendation.priced
    where = "measured here" if priced == "measured" else f"estimated for {ctx.target.name}"
    reading = (
        f"Each compressor was replayed with its error-feedback memory (the memory column) "
        f"over {records['step'].nunique()} recorded steps, each step cut into messages at "
        f"granularity {run.plan.describe()}; times are predicted for "
        f"{counted(n, 'learner')} on the modelled link, compression {where} (the times of "
        "the recommendation below); the "
        "replay's own compression time here, the median over the warm steps (the first "
        "step excluded), is listed beside it with its spread. "
        + " ".join(answers.replay_answer(summary))
        + " Relative errors above 1 are normal with error feedback: what is sent at a step "
        "includes residuals of earlier steps. Replay is open-loop: it follows the "
        "recorded (uncompressed) trajectory, so it measures error and traffic, not final "
        "accuracy."
    )
    columns = [
        "compressor",
        "memory",
        "ratio",
        "density",
        "quality",
        "buildup",
        "bytes_per_learner",
        "comm_seconds",
        "compress_seconds",
        "seconds",
        "measured_compress_seconds",
        "measured_compress_spread",
        "rel_error",
        "cosine",
    ]
    return Part(reading, [plot_replay(records)], [("mean over steps", _human(summary[columns]))])


#: The recommendation of a cluster of one: nothing to price.
ALONE = (
    "One learner communicates nothing, so compression cannot pay off and there is no "
    "recommendation to make; give --cluster-size N (2 or more) to price compression for "
    "N learners (errors are still measured with the capture's learner)."
)


def _recommend(ctx: ReportContext) -> Part:
    if ctx.cost_learners < 2:
        return Part(ALONE, verdict=[ALONE])
    result = ctx.recommendation
    lines = result.explanation()
    assumed = ["Assumed: " + a + "." for a in result.assumptions()]
    if result.winner is not None and result.settings:
        lines.append(
            "Settings: "
            + ", ".join(
                f"{k} = {v:g}" if isinstance(v, float) else f"{k} = {v}"
                for k, v in result.settings.items()
            )
            + "."
        )
    columns = ["compressor", "ratio", "rel_error", "seconds", "speedup", "within_budget"]
    link = ctx.settings.link
    verdict = lines[: 1 if result.pays_off else 2]  # a winner that loses says so
    verdict.append(f"Link: {link.bandwidth * 8 / 1e9:g} Gbit/s, {link.latency * 1e6:g} us.")
    if result.winner is None:
        verdict = ["No candidate fits the error budget: " + lines[0]]
    reading = " ".join(lines + assumed)
    return Part(reading, [], [("candidates", _human(result.ranking[columns]))], verdict)


def _gap(row: pd.Series) -> str:
    low, high = int(row["gap_min"]), int(row["gap_max"])
    steps = f"{low}" if low == high else f"{low} to {high}"
    return f"{steps} training step" + ("" if high == 1 else "s")


#: Column names as people read them, with units; seconds become milliseconds.
HEADERS = {
    "dist": "distribution",
    "ks": "KS",
    "ad": "AD",
    "aic": "AIC",
    "estimator": "estimator",
    "ratio": "ratio k/d",
    "stages": "stages",
    "q median": "q median",
    "q min": "q min",
    "q max": "q max",
    "n": "records",
    "scope": "scope",
    "k": "k",
    "d": "d",
    "steps": "steps",
    "mean_overlap": "overlap",
    "min_overlap": "min overlap",
    "mean_overlap_global": "overlap with mean's top-k",
    "random_overlap": "random overlap",
    "overlap_vs_random": "x random",
    "full_intersection": "all-learner overlap",
    "buildup": "build-up B",
    "random_buildup": "random B",
    "buildup_max": "max B",
    "energy_topk": "energy of own top-k",
    "mean_energy": "energy of leader's top-k",
    "leader_breaks": "CLT breaks",
    "m": "learners m",
    "union": "union |U|",
    "density": "density",
    "allgather_vs_allreduce": "all-gather / dense bytes",
    "learner": "learner",
    "pairs": "step pairs",
    "gap_min": "min gap (steps)",
    "gap_max": "max gap (steps)",
    "mean_jaccard": "Jaccard",
    "compressor": "compressor",
    "quality": "q",
    "bytes_per_learner": "bytes per learner",
    "comm_seconds": "comm (ms)",
    "compress_seconds": "compress (ms)",
    "measured_compress_seconds": "compress here (ms)",
    "measured_compress_spread": "spread here",
    "seconds": "time per step (ms)",
    "rel_error": "relative error",
    "cosine": "cosine",
    "speedup": "speed-up",
    "within_budget": "within budget",
}


def _human(table: pd.DataFrame) -> pd.DataFrame:
    """Human column names with units: seconds as ms, ``qerr@r`` as threshold error."""
    table = table.copy()
    for column in table.columns:
        if str(column).endswith("seconds") or column == "seconds":
            table[column] = table[column] * 1e3
        if str(column).endswith("_spread"):  # interquartile range / median
            table[column] = [f"±{50 * v:.0f} %" for v in table[column]]
    names = {c: HEADERS.get(c, c) for c in table.columns}
    names |= {c: f"threshold error at {c[5:]}" for c in table.columns if str(c).startswith("qerr@")}
    return table.rename(columns=names)


#: The report's sections, in page order.
SECTIONS: tuple[SectionSpec, ...] = (
    SectionSpec("overview", "Capture", _overview),
    SectionSpec("fit", "Distribution fits and threshold estimators", _fit),
    SectionSpec("similarity", "Top-k similarity across learners", _similarity),
    SectionSpec("buildup", "Gradient build-up", _buildup),
    SectionSpec("overlap", "Temporal overlap", _overlap),
    SectionSpec("noise", "Gradient noise scale", noise_section),
    SectionSpec("consistency", "Learner consistency", consistency_section),
    SectionSpec("replay", "Compressor replay", _replay),
    SectionSpec("recommend", "Recommendation", _recommend),
)
