"""``gradstat report``: every analysis of one capture on one self-contained HTML page.

Each section runs one analysis with the report's settings, draws its figures with the
library's plot functions and writes a one-paragraph reading of what the numbers show.
A section that cannot be computed (too few learners, an interrupted capture with too
few steps) says why instead of failing the whole report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from gradstat.analysis.buildup import BuildupParams, buildup, buildup_summary
from gradstat.analysis.compute import Compute
from gradstat.analysis.fit import Fit, magnitude_sample, quality_summary, rank_distributions
from gradstat.analysis.overlap import OverlapParams, overlap_summary, temporal_overlap
from gradstat.analysis.progress import Progress, no_progress
from gradstat.analysis.recommend import choose
from gradstat.analysis.replay import Replay, ReplayParams, summarize_replay
from gradstat.analysis.selection import Selection
from gradstat.analysis.similarity import SimilarityParams, similarity, similarity_summary
from gradstat.compressors.cost import Link
from gradstat.errors import GradstatError
from gradstat.plots.capture import plot_loss
from gradstat.plots.fit import plot_fit
from gradstat.plots.replay import plot_replay
from gradstat.plots.similarity import plot_buildup, plot_overlap, plot_similarity
from gradstat.report.html import Section, render
from gradstat.store import Capture


@dataclass
class ReportSettings:
    """What the report computes; the defaults are the demo's."""

    ratios: Sequence[float] = (0.01, 0.001)
    compressors: str = "fp16,topk,dgc,sidco-gpd,clt-k,powersgd"
    error_budget: float = 0.5
    link: Link = field(default_factory=lambda: Link(10e9 / 8, 5e-6))
    cost_learners: int | None = None
    fit_steps: int = 5
    dpi: int = 110
    compute: Compute = field(default_factory=Compute)


def _overview(cap: Capture, settings: ReportSettings, progress: Progress) -> Section:
    summary = cap.describe()
    steps = cap.steps
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
            ("bytes on disk", f"{summary['bytes'] / 1e6:.1f} MB"),
            ("command", str(cap.meta.get("command", ""))),
        ],
        columns=["", "value"],
    )
    if cap.status == "complete":
        state = "The capture is complete."
    else:
        last = f"step {steps[-1]}" if len(steps) else "before its first step"
        state = f"The capture was {cap.status} and is read up to {last}, its last committed step."
    reading = (
        f"{cap.world_size} learners trained {cap.workload} with real data-parallel "
        f"training{'' if not cap.is_sample else f'; {cap.learners_text()} recorded'}. {state}"
    )
    figures = []
    if len(steps):
        first, last = np.nanmean(cap.losses[:, 0]), np.nanmean(cap.losses[:, -1])
        reading += (
            f" The learners' mean loss went from {first:.3g} to {last:.3g} over the recorded "
            "steps; each learner's curve is its own batch, so the spread between curves is "
            "the data-parallel noise that makes their gradients differ."
        )
        figures.append(plot_loss(steps, cap.losses, f"{cap.path.name}: training loss per learner"))
    return Section("overview", "Capture", reading, figures, [("capture", facts)])


def _fit(cap: Capture, settings: ReportSettings, progress: Progress) -> Section:
    chosen = np.unique(np.linspace(0, len(cap.steps) - 1, settings.fit_steps).round().astype(int))
    steps = ",".join(str(int(cap.steps[i])) for i in chosen) if len(cap.steps) else None
    analysis = Fit(
        cap,
        dists="all",
        ratios=settings.ratios,
        steps=steps,
        sample=200_000,
        compute=settings.compute,
    )
    records = analysis.run(progress)
    ranking = rank_distributions(records)
    quality = quality_summary(records)
    best = ranking.iloc[0]
    sidco = quality[(quality["estimator"] == "sidco-gpd")]
    parts = [
        f"{int(r['stages'])} stage{'s' if r['stages'] != '1' else ''} at {r['ratio']:g}: "
        f"median q {r['q median']:.3g}"
        for r in sidco.to_dict(orient="records")
        if r["stages"] != "auto"
    ]
    reading = (
        f"Of the distributions fitted to |g| of the whole model ({len(analysis.steps)} steps x "
        f"{len(analysis.learners)} learners), {best['dist']} fits best by the "
        f"Kolmogorov-Smirnov statistic (median {best['ks']:.3g}). SIDCo's estimator "
        "with the generalized Pareto distribution selects q = selected / k of the target: "
        + "; ".join(parts)
        + ". q near 1 means the estimated threshold keeps the intended number of elements "
        "without a sort; a single stage is often off by a large factor at small densities "
        "and more stages fix it."
    )
    step, learner, scope = analysis.steps[0], analysis.learners[0], analysis.scopes[0]
    one = records[
        (records["step"] == step)
        & (records["learner"] == learner)
        & (records["scope"] == scope.name)
    ]
    figure = plot_fit(
        one,
        magnitude_sample(cap, step, learner, scope),
        f"{cap.path.name}: step {step}, learner {learner}, whole model",
    )
    return Section(
        "fit",
        TITLES["fit"],
        reading,
        [figure],
        [
            ("distributions ranked by KS", ranking),
            ("threshold estimators: q = selected / k", quality),
        ],
    )


def _similarity(cap: Capture, settings: ReportSettings, progress: Progress) -> Section:
    ratio = min(settings.ratios)
    result = similarity(
        cap,
        Selection.of(cap),
        SimilarityParams(ratio),
        compute=settings.compute,
        progress=progress,
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
    return Section(
        "similarity",
        "Top-k similarity across learners",
        reading,
        [plot_similarity(result.pairs)],
        [("summary over steps", summary)],
    )


def _buildup(cap: Capture, settings: ReportSettings, progress: Progress) -> Section:
    records = buildup(
        cap,
        Selection.of(cap),
        BuildupParams(settings.ratios),
        compute=settings.compute,
        progress=progress,
    )
    summary = buildup_summary(records)
    n = int(summary["m"].max())
    full = summary[summary["m"] == n]
    parts = [
        f"at density {r['ratio']:g} the union of {n} learners' top-k sets is "
        f"{r['buildup']:.2f}x k (random sets: {r['random_buildup']:.2f}x), so an all-gather "
        f"moves {r['density']:.3%} of the gradient"
        for r in full.to_dict(orient="records")
    ]
    reading = (
        "Gradient build-up: " + "; ".join(parts) + ". Build-up below the random baseline "
        "means the learners agree on the important coordinates; it still grows with the "
        "number of learners, which is why all-gathered sparse gradients stop paying off at "
        "scale (a dense all-reduce moves the whole vector once)."
    )
    return Section(
        "buildup", "Gradient build-up", reading, [plot_buildup(records)], [("B(m)", summary)]
    )


def _overlap(cap: Capture, settings: ReportSettings, progress: Progress) -> Section:
    ratio = min(settings.ratios)
    records = temporal_overlap(
        cap,
        Selection.of(cap),
        OverlapParams(ratio),
        compute=settings.compute,
        progress=progress,
    )
    summary = overlap_summary(records)
    mean_row = summary[summary["learner"].astype(str) == "mean"].iloc[0]
    learners = summary[summary["learner"].astype(str) != "mean"]
    reading = (
        f"Between consecutive recorded steps ({_gap(mean_row)} apart) a learner keeps "
        f"{learners['mean_overlap'].mean():.1%} of its "
        f"top-k indices at density {ratio:g}, and the mean gradient keeps "
        f"{mean_row['mean_overlap']:.1%} (random sets: {mean_row['random_overlap']:.2%}). "
        "High temporal overlap means indices chosen at one step stay good for the next, "
        "which is what index-reuse and error-feedback schemes exploit."
    )
    return Section(
        "overlap", "Temporal overlap", reading, [plot_overlap(records)], [("per learner", summary)]
    )


@dataclass
class _ReplayRun:
    """One replay shared by the replay and recommendation sections."""

    run: Replay
    records: pd.DataFrame


def _replay_run(cap: Capture, settings: ReportSettings, progress: Progress) -> _ReplayRun:
    params = ReplayParams(
        settings.compressors,
        settings.ratios,
        settings.link,
        cost_learners=settings.cost_learners,
        skip_unfit=True,
    )
    run = Replay(cap, Selection.of(cap), params, compute=settings.compute)
    return _ReplayRun(run, run.run(progress))


def _replay(cap: Capture, settings: ReportSettings, shared: _ReplayRun) -> Section:
    records, n = shared.records, shared.run.cost_learners
    summary = summarize_replay(records, settings.link, n)
    best = summary.sort_values("rel_error").iloc[0]
    fastest = summary.sort_values("seconds").iloc[0]
    reading = (
        f"Each compressor was replayed with error feedback over {records['step'].nunique()} "
        f"recorded steps. The smallest mean relative error is {_label(best)} "
        f"({best['rel_error']:.3g}); the fastest predicted step is {_label(fastest)} "
        f"({fastest['seconds'] * 1e3:.3g} ms for {n} learners on the modelled link). "
        "Relative errors above 1 are normal with error feedback: what is sent at a step "
        "includes residuals of earlier steps. Replay is open-loop: it follows the "
        "recorded (uncompressed) trajectory, so it measures error and traffic, not final "
        "accuracy."
    )
    columns = [
        "compressor",
        "ratio",
        "density",
        "quality",
        "buildup",
        "bytes_per_learner",
        "comm_seconds",
        "compress_seconds",
        "rel_error",
        "cosine",
    ]
    return Section(
        "replay",
        TITLES["replay"],
        reading,
        [plot_replay(records)],
        [("mean over steps", summary[columns])],
    )


def _recommend(cap: Capture, settings: ReportSettings, shared: _ReplayRun) -> Section:
    result = choose(shared.run, shared.records, error_budget=settings.error_budget)
    reading = " ".join(result.explanation())
    if result.winner is not None and result.settings:
        reading += (
            " Settings: " + ", ".join(f"{k} = {v:g}" for k, v in result.settings.items()) + "."
        )
    columns = ["compressor", "ratio", "rel_error", "seconds", "speedup", "within_budget"]
    return Section(
        "recommend", TITLES["recommend"], reading, [], [("candidates", result.ranking[columns])]
    )


def _gap(row: pd.Series) -> str:
    low, high = int(row["gap_min"]), int(row["gap_max"])
    steps = f"{low}" if low == high else f"{low} to {high}"
    return f"{steps} training step" + ("" if high == 1 else "s")


def _label(row: pd.Series) -> str:
    return row["compressor"] + (f" at {row['ratio']:g}" if pd.notna(row["ratio"]) else "")


BUILDERS = {
    "overview": _overview,
    "fit": _fit,
    "similarity": _similarity,
    "buildup": _buildup,
    "overlap": _overlap,
}
TITLES = {
    "overview": "Capture",
    "fit": "Distribution fits and threshold estimators",
    "similarity": "Top-k similarity across learners",
    "buildup": "Gradient build-up",
    "overlap": "Temporal overlap",
    "replay": "Compressor replay",
    "recommend": "Recommendation",
}
#: The report's sections, in page order.
SECTIONS = tuple(TITLES)


def _guarded(key: str, builder: Callable[..., Section], *args) -> Section:
    """The section, or one that says why it could not be made."""
    try:
        return builder(*args)
    except GradstatError as exc:
        return Section(key, TITLES[key], error=str(exc))


def build_report(
    cap: Capture,
    settings: ReportSettings | None = None,
    progress: Callable[[str], Progress] | None = None,
) -> str:
    """The report page for ``cap`` as an HTML string.

    ``progress(section)`` returns the step-progress wrapper to use for that section.
    """
    settings = settings or ReportSettings()
    wrap = progress or (lambda key: no_progress)
    sections = [
        _guarded(key, builder, cap, settings, wrap(key)) for key, builder in BUILDERS.items()
    ]
    try:
        shared = _replay_run(cap, settings, wrap("replay"))
    except GradstatError as exc:
        sections += [Section(key, TITLES[key], error=str(exc)) for key in ("replay", "recommend")]
    else:
        sections.append(_guarded("replay", _replay, cap, settings, shared))
        sections.append(_guarded("recommend", _recommend, cap, settings, shared))
    subtitle = (
        f"{cap.path} · {cap.learners_text()} · {len(cap.steps)} recorded steps · "
        f"status {cap.status} · made {time.strftime('%Y-%m-%d %H:%M')}"
    )
    return render(f"gradstat report: {cap.path.name}", subtitle, sections, dpi=settings.dpi)
