"""``gradstat fit``: distribution fits, goodness of fit and threshold estimators
(docs/methods.md sections 1 and 2; SIDCo, arXiv 2101.10761)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import typer

from gradstat.analysis.fit import (
    DEFAULT_ESTIMATORS,
    Fit,
    magnitude_sample,
    quality_summary,
    rank_distributions,
)
from gradstat.cli.options import (
    CaptureArg,
    CsvOpt,
    Device,
    DpiOpt,
    Jobs,
    JsonOpt,
    LearnersOpt,
    Memory,
    PlotOpt,
    ScopeOpt,
    StageFit,
    StepsOpt,
    Zeros,
    compute_options,
)
from gradstat.cli.output import df_table, emit, note_sample, progress, warn
from gradstat.errors import UsageError
from gradstat.plots.paths import check_plot_path
from gradstat.store import open_capture

DistOpt = typer.Option(
    "gpd",
    "--dist",
    help="gpd, exp, gamma, normal, laplace, lognormal, weibull, a comma list, or all.",
)
MethodOpt = typer.Option("moments", "--method", help="Fit by 'moments' or 'mle'.")
RatiosOpt = typer.Option("0.1,0.01,0.001", "--ratios", help="Target densities k/d, each in (0, 1).")
StagesOpt = typer.Option(
    "1,2,3", "--stages", help="SIDCo stage counts, e.g. 1,2,3, or 'auto' (adaptive)."
)
EstimatorsOpt = typer.Option(
    ",".join(DEFAULT_ESTIMATORS),
    "--estimators",
    help="Threshold estimators to run (comma list; empty for none).",
)
HardOpt = typer.Option(
    None, "--hard", help="Also run the hard threshold |g| >= LAMBDA.", show_default=False
)
SampleOpt = typer.Option(
    1_000_000,
    "--sample",
    min=0,
    help="Subsample size for MLE fits and KS/AD scores (0: every value).",
)
PlotStepOpt = typer.Option(
    None, "--plot-step", help="Step drawn by --plot (default: the first selected)."
)
SeedOpt = typer.Option(0, "--seed", help="Seed of the subsample and of DGC's sampling.")


def _params_text(params: dict | None) -> str:
    """``c=0.21 scale=0.0103``: scipy's names, a fixed loc = 0 left out."""
    if not isinstance(params, dict):
        return ""
    return " ".join(f"{k}={v:.3g}" for k, v in params.items() if not (k == "loc" and v == 0))


def _fit_table(records: pd.DataFrame) -> pd.DataFrame:
    """One row per (step, learner, scope, dist): parameters, scores, q at each ratio."""
    fits = records[records["kind"] == "fit"]
    keys = ["step", "learner", "scope", "dist"]
    first = fits.drop_duplicates(keys).set_index(keys)
    table = first[["params", "ks", "ad"]].copy()
    table["params"] = [_params_text(p) for p in table["params"]]
    quality = fits.pivot_table(index=keys, columns="ratio", values="quality", aggfunc="first")
    for ratio in sorted(fits["ratio"].unique(), reverse=True):
        table[f"q@{ratio:g}"] = quality[ratio] if ratio in quality else float("nan")
    errors = fits.dropna(subset=["error"]).groupby(keys)["error"].first()
    table["note"] = errors.reindex(table.index).fillna("")
    return table.reset_index()


def fit_command(
    capture: Path = CaptureArg,
    dist: str = DistOpt,
    method: str = MethodOpt,
    scope: str = ScopeOpt,
    steps: str | None = StepsOpt,
    learners: str | None = LearnersOpt,
    ratios: str = RatiosOpt,
    stages: str = StagesOpt,
    estimators: str = EstimatorsOpt,
    hard: float | None = HardOpt,
    zeros: Zeros = "exclude",
    stage_fit: StageFit = "moments",
    sample: int = SampleOpt,
    seed: int = SeedOpt,
    as_json: bool = JsonOpt,
    csv: Path | None = CsvOpt,
    plot: Path | None = PlotOpt,
    plot_step: int | None = PlotStepOpt,
    dpi: int = DpiOpt,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """Fit distributions to gradient magnitudes, score them (KS, Anderson-Darling, AIC/BIC,
    tail-quantile error) and compare threshold estimators (SIDCo-E/P/GP with M stages,
    DGC, Gaussian-k, RedSync, top-k) by quality q = selected / k."""
    check_plot_path(plot)
    with open_capture(capture) as cap:
        note_sample(cap)
        analysis = Fit(
            cap,
            dists=dist,
            method=method,
            scope=scope,
            steps=steps,
            learners=learners,
            ratios=ratios,
            stages=stages,
            estimators=estimators,
            hard_threshold=hard,
            zeros=zeros,
            stage_fit=stage_fit,
            sample=sample or None,
            seed=seed,
            compute=compute_options(device, memory, jobs),
        )
        if plot_step is not None and plot_step not in analysis.steps:
            raise UsageError(f"--plot-step {plot_step} is not among the selected steps")
        records = analysis.run(lambda units: progress(units, "fit"))
        if plot is not None:
            _plot(cap, analysis, records, plot, plot_step, dpi, seed)
    failed = records.dropna(subset=["error"])
    for message, group in failed.groupby("error", sort=False):
        warn(f"{len(group)} records not computed: {message}")
    tables = [
        df_table(
            _fit_table(records),
            f"{method} fits to |g| (zeros excluded; normal and Laplace fitted to g, scored "
            "folded); q@ratio = selected / k of the fitted upper quantile",
        ),
        df_table(
            rank_distributions(records),
            "distributions ranked by median KS (AD, AIC: medians; qerr = relative error of "
            "the fitted threshold vs the k-th largest |g|)",
        ),
    ]
    summary = quality_summary(records)
    if not summary.empty:
        tables.append(
            df_table(summary, "estimation quality q = selected / k (1 is perfect) over records")
        )
    emit(records, as_json=as_json, csv=csv, tables=tables)


def _plot(cap, analysis: Fit, records, path: Path, step: int | None, dpi: int, seed: int) -> None:
    from gradstat.plots.fit import plot_fit
    from gradstat.plots.style import save_figure

    step = analysis.steps[0] if step is None else step
    learner, scope = analysis.learners[0], analysis.scopes[0]
    chosen = records[
        (records["step"] == step)
        & (records["learner"] == learner)
        & (records["scope"] == scope.name)
    ]
    magnitudes = magnitude_sample(cap, step, learner, scope, seed=seed)
    title = f"step {step}, learner {learner}, scope {scope.name}"
    save_figure(plot_fit(chosen, magnitudes, title), path, dpi=dpi)
