"""``gradstat replay`` and ``gradstat recommend``: compressors with error feedback replayed
over a capture, and the fastest compressor and rate within an error budget
(docs/methods.md sections 4 and 5)."""

from __future__ import annotations

import math
from enum import Enum
from pathlib import Path

import pandas as pd
import typer
from rich.panel import Panel

from gradstat.analysis.recommend import (
    DEFAULT_CANDIDATES,
    DEFAULT_RATIOS,
    RecommendParams,
    recommend,
)
from gradstat.analysis.replay import Replay, ReplayParams, dense_seconds, summarize_replay
from gradstat.analysis.selection import Selection
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
    StepsOpt,
    compute_options,
)
from gradstat.cli.output import df_table, emit, err_console, note_sample, progress, to_json
from gradstat.compressors.cost import Link, parse_link
from gradstat.compressors.registry import REGISTRY, parse_compressors
from gradstat.errors import DataError, UsageError
from gradstat.plots.paths import check_plot_path
from gradstat.store import open_capture


class Baseline(str, Enum):
    """The dense all-reduce a compressor must beat."""

    fp32 = "fp32"
    fp16 = "fp16"


BandwidthOpt = typer.Option(
    "10Gbit/s", "--bandwidth", help="Link bandwidth, e.g. 10Gbit/s, 25Gbps or 1.25GB/s."
)
LatencyOpt = typer.Option("5us", "--latency", help="Per-message latency, e.g. 5us or 0.2ms.")
RankOpt = typer.Option(4, "--rank", min=1, help="PowerSGD rank r (powersgd:rank=R overrides).")
BetaOpt = typer.Option(
    1.0, "--beta", help="CLT-k low-pass memory factor in (0, 1] (clt-k:beta=B overrides)."
)
BaselineOpt = typer.Option(
    Baseline.fp32, "--baseline", help="Dense all-reduce to beat: fp32 or fp16."
)
OutOpt = typer.Option(None, "--out", help="Write the recommendation as JSON (e.g. config.json).")
ThreadsOpt = typer.Option(
    1,
    "--threads",
    min=1,
    help="Torch CPU threads while replaying; compress times are per learner on this many.",
)
SeedOpt = typer.Option(0, "--seed", help="Seed of random-k, DGC sampling, QSGD and TernGrad.")

_TRAFFIC_COLUMNS = {
    "compressor": "compressor",
    "ratio": "ratio",
    "density": "density",
    "quality": "q",
    "buildup": "B",
    "bytes_per_learner": "bytes",
    "comm_ms": "comm ms",
    "speedup": "speed-up",
}
_ERROR_COLUMNS = {
    "compressor": "compressor",
    "ratio": "ratio",
    "rel_error": "rel error",
    "cosine": "cosine",
    "memory_norm": "memory",
    "compress_ms": "compress ms",
}


def _display(summary: pd.DataFrame, columns: dict[str, str]) -> pd.DataFrame:
    """Columns under short headers, times in ms; fixed-rate compressors show '-' as ratio."""
    summary = summary.assign(
        comm_ms=summary["comm_seconds"] * 1e3,
        compress_ms=summary["compress_seconds"] * 1e3,
        ms=(summary["comm_seconds"] + summary["compress_seconds"]) * 1e3,
    )
    if "within_budget" in summary:
        summary["fits"] = summary["within_budget"].map({True: "yes", False: "no"})
    summary["bytes_per_learner"] = summary["bytes_per_learner"].round().astype(int)
    shown = summary[list(columns)].rename(columns=columns)
    shown["ratio"] = [("-" if math.isnan(r) else f"{r:g}") for r in summary["ratio"]]
    return shown


def _link_text(link: Link) -> str:
    return f"{link.bandwidth * 8 / 1e9:.4g} Gbit/s, latency {link.latency * 1e6:.4g} us"


def replay_command(
    capture: Path = CaptureArg,
    compressors: str = typer.Option(
        "topk,dgc,sidco-gpd,clt-k,powersgd",
        "--compressors",
        help=f"Comma-separated NAME[:PARAM=VALUE] of {', '.join(REGISTRY)} (docs/replay.md).",
    ),
    ratios: str = typer.Option(
        "0.01,0.001", "--ratios", help="Densities k/d of the sparsifiers (others run once)."
    ),
    bandwidth: str = BandwidthOpt,
    latency: str = LatencyOpt,
    rank: int = RankOpt,
    beta: float = BetaOpt,
    scope: str = ScopeOpt,
    steps: str | None = StepsOpt,
    learners: str | None = LearnersOpt,
    seed: int = SeedOpt,
    threads: int = ThreadsOpt,
    as_json: bool = JsonOpt,
    csv: Path | None = CsvOpt,
    plot: Path | None = PlotOpt,
    dpi: int = DpiOpt,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """Replay compressors with error feedback over consecutive recorded steps: density,
    estimation quality, build-up, bytes, predicted communication time (alpha-beta model),
    relative error and cosine against the true mean gradient, compression time."""
    link = parse_link(bandwidth, latency)
    specs = parse_compressors(compressors, {"rank": rank, "beta": beta})
    check_plot_path(plot)
    params = ReplayParams(specs, ratios, link, seed=seed, threads=threads)
    compute = compute_options(device, memory, jobs)
    with open_capture(capture) as cap:
        note_sample(cap)
        selection = Selection.of(cap, steps, learners, scope)
        run = Replay(cap, selection, params, compute=compute)
        records = run.run(lambda units: progress(units, "replay"))
    n = run.cost_learners
    summary = summarize_replay(records, link, n)
    dense = ", ".join(
        f"{scope_name}: {dense_seconds(int(d), n, link) * 1e3:.3g} ms"
        for scope_name, d in summary.groupby("scope", sort=False)["numel"].first().items()
    )
    tables = []
    for scope_name in summary["scope"].unique():
        rows = summary[summary["scope"] == scope_name]
        tables.append(
            df_table(
                _display(rows, _TRAFFIC_COLUMNS),
                f"replay of {len(run.learners)} learners over {len(run.steps)} steps "
                f"(cost model: {n} learners), scope {scope_name}, "
                f"{_link_text(link)}; means over steps. q = selected/k, B = union/k, bytes "
                "sent per learner per step, comm = predicted communication, speed-up = "
                f"dense fp32 all-reduce ({dense}) / (comm + compress)",
            )
        )
        tables.append(
            df_table(
                _display(rows, _ERROR_COLUMNS),
                f"error of the aggregate, scope {scope_name}: rel error = ||ĝ-g||²/||g||² "
                "and cosine against the mean gradient (DGC: the dense momentum update), "
                "memory = mean norm after the last step, compress ms = time per learner here",
            )
        )
    emit(
        records,
        as_json=as_json,
        csv=csv,
        tables=tables,
        json_document={
            "learners": len(run.learners),
            "world_size": cap.world_size,
            "cost_learners": n,
            "bandwidth_bytes_per_second": link.bandwidth,
            "latency_seconds": link.latency,
            "records": records.to_dict(orient="records"),
            "summary": summary.to_dict(orient="records"),
        },
    )
    if plot is not None:
        from gradstat.plots.replay import plot_replay
        from gradstat.plots.style import save_figure

        save_figure(plot_replay(records), plot, dpi=dpi)


#: Over-budget candidates the recommend table shows (closest first); --json has all.
_OVER_BUDGET_SHOWN = 5
_RANKING_COLUMNS = {
    "compressor": "compressor",
    "ratio": "ratio",
    "rel_error": "rel error",
    "fits": "fits",
    "bytes_per_learner": "bytes",
    "ms": "ms/step",
    "speedup": "speed-up",
}


def recommend_command(
    capture: Path = CaptureArg,
    error_budget: float = typer.Option(
        ...,
        "--error-budget",
        help="Largest acceptable mean relative error ||ĝ-g||²/||g||², e.g. 0.2.",
    ),
    bandwidth: str = BandwidthOpt,
    latency: str = LatencyOpt,
    cluster: int | None = typer.Option(
        None,
        "--learners",
        help="Cluster size for the cost model (default: the run's world size).",
    ),
    baseline: Baseline = BaselineOpt,
    compressors: str = typer.Option(
        DEFAULT_CANDIDATES, "--compressors", help="Candidates, NAME[:PARAM=VALUE], comma-separated."
    ),
    ratios: str = typer.Option(DEFAULT_RATIOS, "--ratios", help="Candidate densities k/d."),
    rank: int = RankOpt,
    beta: float = BetaOpt,
    steps: str | None = StepsOpt,
    seed: int = SeedOpt,
    threads: int = ThreadsOpt,
    out: Path | None = OutOpt,
    as_json: bool = JsonOpt,
    csv: Path | None = CsvOpt,
    device: Device = "auto",
    memory: Memory = None,
    jobs: Jobs = None,
) -> None:
    """The compressor and rate with the lowest predicted time per step (communication +
    compression) whose mean relative error stays within the budget, against the dense
    baseline; its concrete settings, why it won and what came next."""
    link = parse_link(bandwidth, latency)
    specs = parse_compressors(compressors, {"rank": rank, "beta": beta})
    if out is not None and not out.parent.exists():
        raise UsageError(f"--out {out}: folder {out.parent} does not exist")
    params = RecommendParams(
        error_budget,
        link,
        cost_learners=cluster,
        baseline=baseline.value,
        compressors=specs,
        ratios=ratios,
        seed=seed,
        threads=threads,
    )
    compute = compute_options(device, memory, jobs)
    with open_capture(capture) as cap:
        note_sample(cap)
        result = recommend(
            cap,
            Selection.of(cap, steps),
            params,
            compute=compute,
            progress=lambda units: progress(units, "recommend"),
        )
    document = result.to_dict()
    fits = int(result.ranking["within_budget"].sum())
    shown = result.ranking.iloc[: fits + _OVER_BUDGET_SHOWN]
    hidden = len(result.ranking) - len(shown)
    ranking = _display(shown, _RANKING_COLUMNS)
    title = (
        f"candidates for {result.cost_learners} learners ({_link_text(link)}), budget "
        f"{error_budget:g}: within budget fastest first, then the rest by error; ms/step = "
        "predicted communication + compression; speed-up over the dense "
        f"{result.baseline} all-reduce ({result.baseline_seconds * 1e3:.3g} ms)"
        + (f"; {hidden} more over budget in --json / --csv" if hidden else "")
    )
    text = "\n".join(result.explanation())
    if result.winner is not None and result.settings:
        settings = ", ".join(f"{k}={v:.4g}" for k, v in result.settings.items())
        text = f"[bold]{result.winner['compressor']}[/bold] settings: {settings}\n{text}"
    emit(
        result.ranking,
        as_json=as_json,
        csv=csv,
        tables=[df_table(ranking, title), Panel(text, title="recommendation")],
        json_document=document,
    )
    if result.winner is None:
        c = result.closest
        name = c["compressor"] if math.isnan(c["ratio"]) else f"{c['compressor']} {c['ratio']:g}"
        raise DataError(
            f"no candidate keeps the mean relative error within {error_budget:g}; the closest "
            f"is {name} with {c['rel_error']:.3g} (raise --error-budget or add ratios)"
        )
    if out is not None:
        try:
            out.write_text(to_json(document) + "\n")
        except OSError as exc:
            raise UsageError(f"--out {out}: cannot write ({exc.strerror})") from exc
        err_console.print(f"[dim]wrote {out}[/dim]")
