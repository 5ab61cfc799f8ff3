"""``gradstat replay`` and ``gradstat recommend``: compressors with error feedback replayed
over a capture, and the fastest compressor and rate within an error budget
(docs/methods.md sections 4 and 5)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer
from rich.markup import escape

from gradstat.analysis.recommend import (
    DEFAULT_CANDIDATES,
    DEFAULT_RATIOS,
    Recommendation,
    RecommendParams,
    recommend,
)
from gradstat.analysis.replay import Replay, ReplayParams, dense_seconds, summarize_replay
from gradstat.analysis.replay_records import totals
from gradstat.analysis.screening import SCREEN_VALUES
from gradstat.analysis.selection import Selection
from gradstat.cli.options import (
    BANDWIDTH,
    BETA,
    COMPRESSOR_NAMES,
    DPI,
    LATENCY,
    RANK,
    RATIOS,
    SEED,
    THREADS,
    Bandwidth,
    Baseline,
    BaselineOpt,
    Beta,
    Capture,
    ClusterSize,
    Compressors,
    Csv,
    Dense,
    DenseBelow,
    Detail,
    Device,
    Dpi,
    ErrorBudget,
    Granularity,
    Jobs,
    Json,
    Latency,
    Learners,
    Memory,
    Plot,
    Rank,
    Ratios,
    Scope,
    Seed,
    Steps,
    Threads,
    between,
    compute_options,
    list_compressors,
)
from gradstat.cli.output import (
    Output,
    Result,
    View,
    err_console,
    note_sample,
    progress,
    show,
    to_json,
)
from gradstat.cli.paths import out_path
from gradstat.compressors.cost import Link
from gradstat.compressors.registry import REGISTRY
from gradstat.compressors.spec import parse_compressors
from gradstat.compressors.targets import TARGET_NAMES, resolve_target
from gradstat.defaults import REPLAYED
from gradstat.errors import DataError, UsageError
from gradstat.formatting import counted
from gradstat.report.answers import replay_answer
from gradstat.store import open_capture
from gradstat.threads import torch_threads

Out = Annotated[
    Path | None,
    typer.Option(
        "--out", metavar="PATH", callback=out_path, help="Write the recommendation as JSON."
    ),
]
Candidates = Annotated[
    str,
    typer.Option(
        "--compressors",
        metavar="LIST",
        callback=list_compressors,
        is_eager=True,
        help=f"Candidates, comma-separated: {COMPRESSOR_NAMES} Default: every built-in but "
        + " and ".join(
            n for n, e in REGISTRY.items() if not e.candidate and "algorithm" not in e.params
        )
        + ", of the number formats fp16 and bf16; on an FSDP2 capture every format and the "
        "others that can run in a reduce-scatter (docs/compressors.md).",
    ),
]
Target = Annotated[
    str,
    typer.Option(
        "--target",
        metavar="NAME",
        help=f"Hardware the learners compress on: {', '.join(TARGET_NAMES)} (docs/replay.md).",
    ),
]
TargetFile = Annotated[
    Path | None,
    typer.Option(
        "--target-file",
        metavar="PATH",
        help="A hardware profile as JSON (docs/replay.md), instead of --target.",
    ),
]
ScreenValues = Annotated[
    int,
    typer.Option(
        "--screen",
        metavar="N",
        callback=between(0),
        help="Screen every candidate first on a column sample of about N values per "
        "learner (the leading rows of each parameter) and replay only those that can still "
        "win on the whole model; 0: replay every candidate on the whole model "
        "(docs/replay.md).",
    ),
]
#: Over-budget candidates the recommend table shows (closest first); --json has all.
OVER_BUDGET_SHOWN = 5


def _display(summary: pd.DataFrame) -> pd.DataFrame:
    """Times in ms, whole bytes, ``-`` as the ratio of fixed-rate compressors, yes/no."""
    compress_ms = [f"{v * 1e3:.3g}" for v in summary["compress_seconds"]]
    if "compress_spread" in summary:  # a replay's measured times: with their spread
        cells = [f"±{50 * v:.0f}%" for v in summary["compress_spread"]]
        compress_ms = [f"{t} {c:>5}" for t, c in zip(compress_ms, cells, strict=True)]
        compress_ms = [c.rjust(max(map(len, compress_ms))) for c in compress_ms]
    shown = summary.assign(
        comm_ms=summary["comm_seconds"] * 1e3,
        compress_ms=compress_ms,
        ms=summary["seconds"] * 1e3,
        bytes_per_learner=summary["bytes_per_learner"].round().astype(int),
        ratio=[("-" if math.isnan(r) else f"{r:g}") for r in summary["ratio"]],
    )
    if "within_budget" in shown:
        shown["fits"] = shown["within_budget"].map({True: "yes", False: "no"})
    return shown


def plan_options(granularity: str | None, dense: str | None, dense_below: int) -> dict:
    """``--granularity``, ``--dense`` and ``--dense-below`` as the analyses' keywords."""
    return {"granularity": granularity, "dense": dense, "dense_below": dense_below}


def link_text(link: Link) -> str:
    return f"{link.bandwidth * 8 / 1e9:.4g} Gbit/s, latency {link.latency * 1e6:.4g} us"


def replay_command(
    capture: Capture,
    compressors: Compressors = REPLAYED,
    ratios: Ratios = RATIOS,
    bandwidth: Bandwidth = BANDWIDTH,
    latency: Latency = LATENCY,
    rank: Rank = RANK,
    beta: Beta = BETA,
    scope: Scope = "model",
    granularity: Granularity = None,
    dense: Dense = None,
    dense_below: DenseBelow = 0,
    steps: Steps = None,
    learners: Learners = None,
    seed: Seed = SEED,
    threads: Threads = THREADS,
    as_json: Json = False,
    csv: Csv = None,
    detail: Detail = False,
    plot: Plot = None,
    dpi: Dpi = DPI,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """What each compressor costs and loses, replayed as training communicates.

    Each step cut into messages as training cuts it (--granularity), each compressor
    with its memory (COMPRESSOR+MEMORY: topk+residual, terngrad+none): density,
    quality, build-up, bytes, predicted communication time, relative error and cosine
    against the mean gradient, compression time; --detail: a record per message too.

    Example: gradstat replay captures/lm --compressors topk,clt-k --plot replay.png
    """
    link = Link(bandwidth, latency)
    specs = parse_compressors(compressors, {"rank": rank, "beta": beta})
    # the default set skips PowerSGD where the model has no matrix for it; by name it fails
    optional = ("powersgd",) if compressors == REPLAYED else ()
    plan = plan_options(granularity, dense, dense_below)
    params = ReplayParams(
        specs, ratios, link, seed=seed, optional=optional, threads=threads, detail=detail, **plan
    )
    compute = compute_options(device, memory, jobs)
    with open_capture(capture) as cap, torch_threads(threads):
        note_sample(cap)
        run = Replay(cap, Selection.of(cap, steps, learners, scope), params, compute=compute)
        records = run.run(lambda units: progress(units, "replay"))
    result = replay_result(records, link, len(run.learners), run.cost_learners, run.plan.describe())
    result.document["world_size"], result.figure = cap.world_size, lambda: _plot_replay(records)
    show(result, Output(as_json, csv, detail, plot, dpi))


def replay_result(
    records: pd.DataFrame, link: Link, learners: int, n: int, plan: str = "model"
) -> Result:
    """Traffic and error tables per scope; ``learners`` replayed, ``n`` in the cost model,
    ``plan`` the granularity that ran (``Plan.describe``)."""
    summary = summarize_replay(records, link, n)
    views = []
    for scope, rows in summary.groupby("scope", sort=False):
        shown = _display(rows)
        traffic = _traffic_view(scope, rows, shown, learners, n, link, plan)
        views += [traffic, _error_view(scope, shown)]
    return Result(
        records,
        summary=views,
        answer=replay_answer(summary),
        detail=[_per_step_view(records)],
        document={
            "granularity": plan,
            "learners": learners,
            "cost_learners": n,
            "bandwidth_bytes_per_second": link.bandwidth,
            "latency_seconds": link.latency,
            "records": records.to_dict(orient="records"),
            "summary": summary.to_dict(orient="records"),
        },
    )


def _traffic_view(
    scope: str,
    rows: pd.DataFrame,
    shown: pd.DataFrame,
    learners: int,
    n: int,
    link: Link,
    plan: str,
) -> View:
    """One scope's traffic and time table: ``rows`` its summary, ``shown`` as displayed,
    ``learners`` replayed, ``n`` in the cost model on ``link``, at granularity ``plan``."""
    dense = dense_seconds(int(rows["numel"].iloc[0]), n, link) * 1e3
    alone = (
        " One learner communicates nothing: no comm time and no speed-up to predict."
        if n < 2
        else ""
    )
    if n < 2:
        shown = shown.assign(speedup=math.nan)
    return View(
        f"replay of {counted(learners, 'learner')} over "
        f"{counted(int(rows['steps'].max()), 'step')}, scope {scope}, granularity {plan}: "
        f"traffic and time (cost model: {counted(n, 'learner')})",
        shown,
        {
            "compressor": "compressor",
            "ratio": "ratio",
            "quality": "q",
            "buildup": "B",
            "bytes_per_learner": "bytes",
            "comm_ms": "comm ms",
            "compress_ms": "compress ms",
            "speedup": "speed-up",
        },
        f"Means over steps on {link_text(link)}. q = selected / k; B = union / k "
        "of the indices sent, measured on the corrected vectors g + m (error "
        "feedback), so it exceeds `gradstat buildup`'s on the raw gradients; "
        "bytes sent per learner per step; comm = predicted communication; "
        "compress = time per learner here, median over the steps after the first "
        "(± half its interquartile range); speed-up = dense fp32 all-reduce "
        f"({dense:.3g} ms) / (comm + compress)." + alone,
    )


def _error_view(scope: str, shown: pd.DataFrame) -> View:
    """One scope's table of the aggregate's error against the mean gradient."""
    return View(
        f"error of the aggregate, scope {scope}",
        shown,
        {
            "compressor": "compressor",
            "ratio": "ratio",
            "memory": "memory",
            "density": "density",
            "rel_error": "rel error",
            "cosine": "cosine",
            "memory_norm": "‖m‖",
        },
        "rel error = ||ĝ-g||²/||g||² and cosine against the mean gradient (DGC: the "
        "dense momentum update); memory = the error-feedback memory that ran (+MEMORY "
        "names another), ‖m‖ = its norm after the last step. "
        "Relative errors above 1 are normal with error feedback: what a step sends "
        "includes residuals of earlier steps, which the mean gradient of that step "
        "does not.",
    )


def _per_step_view(records: pd.DataFrame) -> View:
    """Each replayed step of each compressor and ratio (``--detail``), a compressor's
    steps together in the order of the summary."""
    order = {name: i for i, name in enumerate(dict.fromkeys(records["compressor"]))}
    records = records.sort_values(
        ["compressor", "ratio", "step"],
        key=lambda c: c.map(order) if c.name == "compressor" else c,
        ascending=[True, False, True],
        kind="stable",
    )
    shown = records.assign(
        ratio=[("-" if math.isnan(r) else f"{r:g}") for r in records["ratio"]],
        bytes=records["bytes_per_learner"].round().astype(int),
        compress_ms=records["compress_seconds"] * 1e3,
    )
    scopes = records["scope"].nunique() > 1
    columns = {"scope": "scope"} if scopes else {}
    columns |= {
        "compressor": "compressor",
        "ratio": "ratio",
        "step": "step",
        "density": "density",
        "quality": "q",
        "buildup": "B",
        "bytes": "bytes",
        "rel_error": "rel error",
        "cosine": "cosine",
        "memory_norm": "memory",
        "compress_ms": "compress ms",
    }
    return View(
        "replay per step",
        shown,
        columns,
        "memory = error-feedback norm after the step; compress = time per learner here.",
        keys=4 if scopes else 3,
    )


def _plot_replay(records: pd.DataFrame):
    from gradstat.plots.replay import plot_replay

    return plot_replay(totals(records))  # a step's totals, not its messages


def recommend_command(
    capture: Capture,
    error_budget: ErrorBudget,
    bandwidth: Bandwidth = BANDWIDTH,
    latency: Latency = LATENCY,
    cluster_size: ClusterSize = None,
    target: Target = "cpu-here",
    target_file: TargetFile = None,
    baseline: BaselineOpt = Baseline.fp32,
    compressors: Candidates = DEFAULT_CANDIDATES,
    ratios: Ratios = DEFAULT_RATIOS,
    rank: Rank = RANK,
    beta: Beta = BETA,
    granularity: Granularity = None,
    dense: Dense = None,
    dense_below: DenseBelow = 0,
    steps: Steps = None,
    seed: Seed = SEED,
    threads: Threads = THREADS,
    screen: ScreenValues = SCREEN_VALUES,
    out: Out = None,
    as_json: Json = False,
    csv: Csv = None,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """The fastest compressor and rate within an error budget, and its settings.

    The compressor and rate with the lowest predicted time per step (communication +
    compression) whose mean relative error stays within the budget, against the dense
    baseline; its concrete settings, why it won and what came next.

    Example: gradstat recommend captures/lm --error-budget 0.5 --cluster-size 64
    """
    link = Link(bandwidth, latency)
    specs = parse_compressors(compressors, {"rank": rank, "beta": beta})
    profile = target_profile(target, target_file, threads)
    plan = plan_options(granularity, dense, dense_below)
    given = (error_budget, link, cluster_size, baseline.value, specs, ratios, seed, profile)
    params = RecommendParams(*given, threads, **plan, screen=screen)
    compute = compute_options(device, memory, jobs)
    with open_capture(capture) as cap, torch_threads(threads):
        note_sample(cap)
        if (cluster_size or cap.world_size) < 2:
            raise UsageError(
                f"{cap.path} is a run of one learner, which communicates nothing: there is "
                "no compression to recommend; give --cluster-size N (2 or more) to price "
                "it for N learners"
            )
        tick = lambda units: progress(units, "recommend")  # noqa: E731
        selection = Selection.of(cap, steps)
        result = recommend(cap, selection, params, compute=compute, progress=tick, say=_note)
    show(recommend_result(result), Output(as_json, csv))
    if result.winner is None:
        raise _nothing_fits(result.closest, error_budget)
    if out is not None:
        _write_recommendation(result, out)


def _note(text: str) -> None:
    """A line of what recommend does (plain text on stderr, never markup)."""
    err_console.print(f"note: {escape(text)}", highlight=False, soft_wrap=False)


def target_profile(target: str, target_file: Path | None, threads: int):
    """The hardware profile of ``--target`` or ``--target-file`` (a file wins over the
    default ``cpu-here``), measured here on the ``threads`` compression runs on."""
    with torch_threads(threads):
        return resolve_target(None if target_file and target == "cpu-here" else target, target_file)


def _nothing_fits(closest: pd.Series, error_budget: float) -> DataError:
    """The error when no candidate stays within the budget, naming the ``closest``."""
    c = closest
    name = c["compressor"] if math.isnan(c["ratio"]) else f"{c['compressor']} {c['ratio']:g}"
    return DataError(
        f"no candidate keeps the mean relative error within {error_budget:g}; the closest "
        f"is {name} with {c['rel_error']:.3g} (raise --error-budget or add ratios)"
    )


def _write_recommendation(result: Recommendation, out: Path) -> None:
    """``--out``: the recommendation as one JSON document, whole or not at all."""
    from gradstat.atomic import replacing

    with replacing(out, "--out") as handle:
        handle.write((to_json(result.to_dict()) + "\n").encode())
    err_console.print(f"[dim]wrote {escape(str(out))}[/dim]")


def _priced(result: Recommendation) -> str:
    """How compression was priced: measured here, or estimated for another target."""
    if result.priced == "measured":
        return "measured here"
    name = result.target.name if result.target is not None else "the target"
    return f"estimated for {name} (work model)"


def recommend_result(result: Recommendation) -> Result:
    fits = int(result.ranking["within_budget"].sum())
    shown = result.ranking.iloc[: fits + OVER_BUDGET_SHOWN]
    hidden = len(result.ranking) - len(shown)
    answer = result.explanation() + ["Assumed: " + a + "." for a in result.assumptions()]
    if result.pays_off:
        settings = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"  # a user's text parameter
            for k, v in result.settings.items()
        )
        use = f"Use {result.winner['compressor']}" + (f" with {settings}." if settings else ".")
        answer = [use, *answer]
    return Result(
        result.ranking,
        summary=[
            View(
                f"candidates for {result.cost_learners} learners, budget "
                f"{result.error_budget:g}, granularity {result.plan}",
                _display(shown),
                {
                    "compressor": "compressor",
                    "ratio": "ratio",
                    "rel_error": "rel error",
                    "fits": "fits",
                    "bytes_per_learner": "bytes",
                    "ms": "ms/step",
                    "speedup": "speed-up",
                },
                f"{link_text(result.link)}; compression {_priced(result)}. Within "
                "budget fastest first, then the rest by error; ms/step = predicted communication + "
                "compression (per candidate in --json); "
                "speed-up over the "
                f"dense {result.baseline} {result.dense} ({result.baseline_seconds * 1e3:.3g} ms)"
                + (f"; {hidden} more over budget in --json / --csv." if hidden else "."),
            )
        ],
        answer=answer,
        document=result.to_dict(),
    )
