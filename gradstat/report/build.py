"""``gradstat report``: every analysis of one capture on one self-contained HTML page.

:func:`build_report` builds each section of gradstat/report/sections.py in turn; a
section that cannot be computed (too few learners, an interrupted capture with too few
steps) says why instead of failing the whole report. It adds the training section
(gradstat/report/training.py) where the user names runs to compare it with, and the
provenance table (:func:`assumptions`), and renders the page (gradstat/report/html.py).
"""

from __future__ import annotations

import json
import os
import platform
import time
import warnings
from collections.abc import Callable

import pandas as pd
import torch

from gradstat import __version__, defaults
from gradstat.analysis.recommend import fsdp_reduce
from gradstat.compressors.targets import Target, spread_text
from gradstat.errors import DamagedData, GradstatError, GradstatWarning
from gradstat.parallel.progress import Progress, no_progress
from gradstat.report.context import ReportContext, ReportSettings
from gradstat.report.html import Section, render
from gradstat.report.sections import SECTIONS
from gradstat.report.training import TITLE as TRAINING_TITLE
from gradstat.report.training import training_section
from gradstat.store import Capture


def equivalent_command(ctx: ReportContext) -> str:
    """The ``gradstat recommend`` call that gives the report's recommendation."""
    s = ctx.settings
    return (
        f"gradstat recommend {ctx.cap.path} --error-budget {s.error_budget:g} "
        f"--compressors {s.compressors} --ratios {defaults.ratios_text(s.ratios)} "
        f"--cluster-size {ctx.cost_learners} --bandwidth {s.link.bandwidth * 8 / 1e9:g}Gbit/s "
        f"--latency {s.link.latency * 1e6:g}us"
        + (f" --target-file {s.target_file}" if s.target_file else f" --target {ctx.target.name}")
    )


def _target_text(target: Target) -> str:
    return (
        f"{target.name} ({target.description}: memory {target.bandwidth / 1e9:.3g} GB/s"
        f"{spread_text(target, 'bandwidth')}, top-k {target.topk_rate / 1e9:.3g} G "
        f"elements/s{spread_text(target, 'topk_rate')})"
    )


def _parallelism(ctx: ReportContext) -> str:
    """How the run communicated, and so what the recommendation judges against."""
    reduce = fsdp_reduce(ctx.cap)
    if reduce is None:
        return "DDP-style all-reduce of every gradient (the dense baseline: a ring all-reduce)"
    units = len(json.loads(ctx.cap.meta.get("fsdp_units") or "[]"))
    return (
        f"FSDP2, {units} fully_shard units reducing in {reduce}: candidates replayed per "
        "unit inside the reduce-scatter, those with a reduce-scatter form only; the dense "
        "baseline is FSDP's ring reduce-scatter plus the parameter all-gather"
    )


def assumptions(ctx: ReportContext) -> pd.DataFrame:
    """What the numbers assume and where they come from (the report's provenance)."""
    cap, s = ctx.cap, ctx.settings
    link = f"{s.link.bandwidth * 8 / 1e9:g} Gbit/s, latency {s.link.latency * 1e6:g} us"
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads"
    facts = {
        "link": f"{link} (alpha-beta model of a ring all-reduce / all-gather)",
        "cluster size": f"{ctx.cost_learners} learner"
        + ("s" if ctx.cost_learners != 1 else "")
        + " for the cost model; errors and "
        f"build-up measured with the capture's {cap.learners_text()}",
        "target hardware": "communication: the link above; compression: "
        + (
            f"measured here, each candidate's own code on the capture's messages ({machine})"
            if ctx.target.name == "cpu-here"
            else f"the work model on {_target_text(ctx.target)}; replay's own compression "
            f"times measured on {machine}"
        ),
        "data parallelism": _parallelism(ctx),
        "options": f"ratios {defaults.ratios_text(s.ratios)}; compressors {s.compressors}; "
        f"error budget {s.error_budget:g}; fits on {s.fit_steps} evenly spaced steps",
        "same recommendation as": equivalent_command(ctx) if ctx.cost_learners > 1 else "-",
        "capture": f"{cap.path} (created {cap.meta.get('created', 'unknown')})",
        "made with": f"gradstat {__version__}, torch {torch.__version__}, on "
        f"{time.strftime('%Y-%m-%d %H:%M %Z')}",
    }
    return pd.DataFrame(list(facts.items()), columns=["", "value"])


def build_report(
    cap: Capture,
    settings: ReportSettings | None = None,
    progress: Callable[[str], Progress] | None = None,
    allow_damaged: bool = False,
) -> str:
    """The report page for ``cap`` as an HTML string.

    ``progress(section)`` returns the progress wrapper of that section's work units. A
    damaged row (``DamagedData``) stops the report unless ``allow_damaged``: then the
    sections it stops say so and the page is marked damaged.
    """
    ctx = ReportContext(cap, settings or ReportSettings(), progress or (lambda key: no_progress))
    sections, verdicts, damaged = _sections(ctx, allow_damaged)
    try:  # only with runs to compare it with (--with)
        training = training_section(cap, ctx.settings.with_runs, ctx.settings.trained_with)
    except GradstatError as exc:
        training = Section("training", TRAINING_TITLE, error=str(exc))
    if training is not None:
        sections.append(training)
    subtitle = (
        f"{cap.path} · {cap.learners_text()} · {len(cap.steps)} recorded steps · "
        f"status {'damaged' if damaged else cap.status} · gradstat {__version__}"
    )
    return render(
        f"gradstat report: {cap.workload}, {cap.learners_text()}, {len(cap.steps)} steps",
        subtitle,
        sections,
        summary=verdicts,
        provenance=assumptions(ctx),
        dpi=ctx.settings.dpi,
    )


def _sections(
    ctx: ReportContext, allow_damaged: bool
) -> tuple[list[Section], list[tuple[str, list[str]]], bool]:
    """Each section of :data:`SECTIONS` built (or saying why it could not be), the
    summary box's lines, and whether a damaged row left a section out (a warning each;
    without ``allow_damaged`` the ``DamagedData`` error is raised)."""
    sections, verdicts, damaged = [], [], False
    for spec in SECTIONS:
        try:
            part = spec.build(ctx)
        except GradstatError as exc:
            if isinstance(exc, DamagedData):
                if not allow_damaged:
                    raise
                damaged = True
                warnings.warn(
                    f"report: the {spec.title} section is left out: {exc}",
                    GradstatWarning,
                    stacklevel=3,
                )
            sections.append(Section(spec.key, spec.title, error=str(exc)))
            verdicts.append((spec.title, [f"not available: {exc}"]))
            continue
        sections.append(Section(spec.key, spec.title, part.reading, part.figures, part.tables))
        if part.verdict:
            verdicts.append((spec.title, part.verdict))
    return sections, verdicts, damaged
