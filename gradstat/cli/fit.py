"""``gradstat fit``: distribution fits, goodness of fit and threshold estimators
(docs/methods.md sections 1 and 2; SIDCo, arXiv 2101.10761)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from gradstat.cli.options import (
    DPI,
    RATIOS,
    SEED,
    Capture,
    Csv,
    Detail,
    Device,
    Dpi,
    Jobs,
    Json,
    Learners,
    Memory,
    Plot,
    Ratios,
    Scope,
    Seed,
    StageFit,
    Steps,
    Zeros,
    between,
    compute_options,
)
from gradstat.cli.output import Output, Result, View, note_sample, progress, show, warn
from gradstat.defaults import FIT_DISTS, FIT_METHOD, FIT_SAMPLE, FIT_STAGES, STAGE_FIT, ZEROS
from gradstat.defaults import FIT_ESTIMATORS as DEFAULT_ESTIMATORS
from gradstat.errors import UsageError

if TYPE_CHECKING:  # the analysis imports torch and scipy: loaded when the command runs
    import pandas as pd

    from gradstat.analysis.selection import Selection

Dist = Annotated[
    str,
    typer.Option(
        "--dist",
        metavar="NAMES",
        help="gpd, exp, gamma, normal, laplace, lognormal, weibull, a comma list, or all.",
    ),
]
Method = Annotated[str, typer.Option("--method", help="Fit by 'moments' or 'mle'.")]
Stages = Annotated[
    str, typer.Option("--stages", help="SIDCo stage counts, e.g. 1,2,3, or 'auto' (adaptive).")
]
Estimators = Annotated[
    str,
    typer.Option(
        "--estimators",
        metavar="NAMES",
        show_default=False,
        help=f"Threshold estimators, comma-separated; empty for none (default: "
        f"{', '.join(DEFAULT_ESTIMATORS)}).",
    ),
]
Hard = Annotated[
    float | None,
    typer.Option("--hard", metavar="LAMBDA", help="Also run the hard threshold |g| >= LAMBDA."),
]
Sample = Annotated[
    int,
    typer.Option(
        "--sample",
        callback=between(0),
        help="Subsample size of MLE fits and their KS/AD (0: every value); moment fits "
        "score every value.",
    ),
]
PlotStep = Annotated[
    int | None,
    typer.Option("--plot-step", help="Step drawn by --plot (default: the first selected)."),
]

ESTIMATORS = ",".join(DEFAULT_ESTIMATORS)
DISTS = ",".join(FIT_DISTS)
STAGES = ",".join(map(str, FIT_STAGES))


def fit_command(
    capture: Capture,
    dist: Dist = DISTS,
    method: Method = FIT_METHOD,
    scope: Scope = "model",
    steps: Steps = None,
    learners: Learners = None,
    ratios: Ratios = RATIOS,
    stages: Stages = STAGES,
    estimators: Estimators = ESTIMATORS,
    hard: Hard = None,
    zeros: Zeros = ZEROS,
    stage_fit: StageFit = STAGE_FIT,
    sample: Sample = FIT_SAMPLE,
    seed: Seed = SEED,
    as_json: Json = False,
    csv: Csv = None,
    detail: Detail = False,
    plot: Plot = None,
    plot_step: PlotStep = None,
    dpi: Dpi = DPI,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """Which distribution |g| follows, and how close threshold estimators get to k.

    Fits distributions to gradient magnitudes, scores them (KS, Anderson-Darling,
    AIC/BIC, tail-quantile error) and compares threshold estimators (SIDCo-E/P/GP with
    M stages, DGC, Gaussian-k, RedSync, top-k) by quality q = selected / k.

    Example: gradstat fit captures/lm --dist all --plot fit.png
    """
    from gradstat.analysis.fit import FitParams, fit, magnitude_sample
    from gradstat.analysis.selection import Selection
    from gradstat.store import open_capture

    params = FitParams(
        dists=dist,
        method=method,
        ratios=ratios,
        stages=stages,
        estimators=estimators,
        hard_threshold=hard,
        zeros=zeros,
        stage_fit=stage_fit,
        sample=sample or None,
        seed=seed,
    )
    with open_capture(capture) as cap:
        note_sample(cap)
        selection = Selection.of(cap, steps, learners, scope)
        drawn = _drawn(cap, selection, plot_step)
        records = fit(
            cap,
            selection,
            params,
            compute=compute_options(device, memory, jobs),
            progress=lambda units: progress(units, "fit"),
        )
        sample_drawn = magnitude_sample(cap, *drawn, seed=seed) if plot else None
    for message, group in records.dropna(subset=["error"]).groupby("error", sort=False):
        warn(f"{len(group)} records not computed: {message}")
    result = fit_result(records, method)
    if plot is not None:
        result.figure = lambda: _figure(records, drawn, sample_drawn)
    show(result, Output(as_json, csv, detail, plot, dpi))


def _drawn(cap, selection: Selection, plot_step: int | None) -> tuple:
    """``(step, learner, scope)`` that ``--plot`` draws: ``--plot-step`` (which must be
    among the selected steps) or the first selected step, the first learner and scope."""
    if plot_step is not None and plot_step not in selection.steps:
        raise UsageError(f"--plot-step {plot_step} is not among the selected steps")
    step = selection.steps[0] if plot_step is None else plot_step
    return step, selection.learners[0], selection.scopes(cap)[0]


def fit_result(records: pd.DataFrame, method: str) -> Result:
    """The ranking of distributions and the estimators' q, per-row fits as detail."""
    from gradstat.analysis.fit import quality_summary, rank_distributions
    from gradstat.report.answers import best_fit, closest_estimators

    ranking, quality = rank_distributions(records), quality_summary(records)
    estimators = quality[~quality["estimator"].str.startswith("fit:")]
    summary = [
        View(
            f"distributions fitted to |g| ({method}), ranked by median KS",
            ranking,
            {"rank": "rank", "dist": "distribution", "ks": "KS", "ad": "AD"}
            | {c: f"threshold error {c[5:]}" for c in ranking.columns if c.startswith("qerr@")},
            "KS, AD: medians over records; threshold error: relative error of the fitted "
            "upper quantile against the k-th largest |g| at each ratio (0 is exact).",
        ),
        View(
            "threshold estimators: median q = selected / k (1 is exact)",
            _q_by_ratio(estimators),
            note="Ranges over records and the distributions' own quantiles: --detail.",
        ),
    ]
    return Result(
        records,
        summary=summary,
        answer=[best_fit(ranking), *closest_estimators(quality)],
        detail=[
            View("fits per record (q at each ratio)", _fit_table(records), keys=4),
            View("estimation quality q = selected / k over records", quality),
        ],
        document={
            "records": records.to_dict(orient="records"),
            "ranking": ranking.to_dict(orient="records"),
            "quality": quality.to_dict(orient="records"),
        },
    )


def _q_by_ratio(quality: pd.DataFrame) -> pd.DataFrame:
    """One row per (estimator, stages), the median q at each ratio in a column."""
    import pandas as pd

    if quality.empty:
        return pd.DataFrame(columns=["estimator", "stages"])
    wide = quality.pivot_table(
        index=["estimator", "stages"], columns="ratio", values="q median", sort=False
    )
    wide = wide[sorted(wide.columns, reverse=True)]
    wide.columns = [f"q at {r:g}" for r in wide.columns]
    return wide.reset_index()


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


def _figure(records: pd.DataFrame, drawn: tuple, magnitudes):
    from gradstat.plots.fit import plot_fit_at

    step, learner, scope = drawn
    return plot_fit_at(records, magnitudes, step, learner, scope.name)
