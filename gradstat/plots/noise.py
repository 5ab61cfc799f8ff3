"""Figure of the gradient noise scale, from :func:`gradstat.analysis.noise.noise`'s tables.

One scope: B_simple per step with its bootstrap interval over learners, the moving
average (the paper's ratio of moving averages), the ratio over all steps and the batch
the learners make together, on a log axis; below it (with compressors) each
compressor's error over the sampling noise per step, against the line at 1 where the
error equals the gradient's own noise. Several scopes (``--scope layers``): the same per
scope, over steps (the ratio of means, the median interval).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gradstat.analysis.noise import compressor_summary, noise_summary
from gradstat.plots.style import compressor_color, legend_below, new_figure

MARKERS = "osD^vP*X"
#: Scopes up to which the x axis names each one (beyond: their index).
NAMED_SCOPES = 16


def _label(compressor: str, ratio: float) -> str:
    return compressor if math.isnan(ratio) else f"{compressor} {ratio:g}"


def plot_noise(steps: pd.DataFrame, compressors: pd.DataFrame | None = None) -> Figure:
    """B_simple (and the compressors' noise ratios) over steps, or per scope."""
    compressors = compressors if compressors is not None else pd.DataFrame()
    rows = 2 if len(compressors) else 1
    fig, axes = new_figure(rows, 1, width=6.4, height=3.3)
    many = steps["scope"].nunique() > 1
    if many:
        _per_scope(axes[0, 0], noise_summary(steps))
    else:
        _over_steps(axes[0, 0], steps)
    if len(compressors):
        if many:
            _ratios_per_scope(axes[1, 0], compressor_summary(compressors), steps)
        else:
            _ratios_over_steps(axes[1, 0], compressors)
    legend_below(fig, ncols=2)
    return fig


def _over_steps(ax, steps: pd.DataFrame) -> None:
    """B_simple per step with its interval, the moving average, the overall ratio and
    the learners' combined batch."""
    summary = noise_summary(steps).iloc[0]
    measured = np.isfinite(steps["b_simple"]) & (steps["b_simple"] > 0)
    _steps_with_intervals(ax, steps[measured])
    if not measured.all():  # |G|^2 <= 0: a cross at the top edge
        ax.plot(
            steps["step"][~measured],
            np.full(int((~measured).sum()), 0.97),
            "x",
            color="C3",
            transform=ax.get_xaxis_transform(),
            label="|G|² estimate ≤ 0 (B_simple infinite)",
        )
    average = steps["b_simple_avg"].where(np.isfinite(steps["b_simple_avg"]))  # inf: a gap
    ax.plot(steps["step"], average, color="C1", linewidth=1.8, label="moving average")
    if np.isfinite(summary["b_simple"]):
        label = f"over all steps: {summary['b_simple']:.3g}"
        ax.axhline(summary["b_simple"], color="0.3", linestyle="--", linewidth=1.0, label=label)
    n, b = int(summary["learners"]), int(summary["batch_size"])
    label = f"all learners' batch n b = {n * b}"
    ax.axhline(n * b, color="C2", linestyle=":", linewidth=1.4, label=label)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel("B_simple = tr(Σ) / |G|² (samples)")
    ax.set_title(f"gradient noise scale: {n} learners x batch {b}, scope {steps['scope'].iloc[0]}")


def _steps_with_intervals(ax, finite: pd.DataFrame) -> None:
    """The steps' B_simple with their intervals; one without an upper end is an arrow
    to the top of the axes."""
    bounded = np.isfinite(finite["ci_high"])
    has_interval = not finite["ci_low"].isna().all()
    errors = None
    if has_interval:
        low = (finite["b_simple"] - finite["ci_low"]).clip(lower=0)
        errors = [low, (finite["ci_high"] - finite["b_simple"]).where(bounded, 0).clip(lower=0)]
    label = "B_simple of a step" + (", 95% interval over learners" if has_interval else "")
    ax.errorbar(
        finite["step"],
        finite["b_simple"],
        yerr=errors,
        fmt="o",
        markersize=3.5,
        capsize=2.5,
        color="C0",
        label=label,
    )
    if not has_interval or bounded.all():
        return
    for x, y in zip(finite["step"][~bounded], finite["b_simple"][~bounded], strict=True):
        ax.annotate(
            "",
            xy=(x, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(x, y),
            textcoords="data",
            arrowprops={"arrowstyle": "->", "color": "C0", "linewidth": 1.0},
        )
    ax.plot([], [], color="C0", marker="^", linewidth=1.0, label="interval without an upper end")


def _scope_axis(ax, names: list[str]) -> None:
    if len(names) <= NAMED_SCOPES:
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=6)
        ax.set_xlabel("")
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("scope (layer index in the capture's order)")


def _per_scope(ax, summary: pd.DataFrame) -> None:
    """Each scope's B_simple over all steps with the median of its steps' intervals."""
    x = np.arange(len(summary))
    value = summary["b_simple"].where(np.isfinite(summary["b_simple"]))
    low = (value - summary["ci_low"]).clip(lower=0)
    high = (summary["ci_high"] - value).clip(lower=0)
    ax.errorbar(
        x,
        value,
        yerr=None if summary["ci_low"].isna().all() else [low, high.where(np.isfinite(high), 0)],
        fmt="o",
        markersize=3.5,
        capsize=2,
        color="C0",
        label="B_simple over steps, median 95% interval",
    )
    ax.set_yscale("log")
    ax.set_ylabel("B_simple (samples)")
    _scope_axis(ax, list(summary["scope"]))
    ax.set_title(f"gradient noise scale per scope, over {int(summary['steps'].max())} steps")


def _ratios_over_steps(ax, compressors: pd.DataFrame) -> None:
    """Each compressor's error over the sampling noise per step, against 1."""
    ratios = sorted(compressors["ratio"].dropna().unique(), reverse=True)
    for (name, ratio), rows in compressors.groupby(
        ["compressor", "ratio"], sort=False, dropna=False
    ):
        marker = MARKERS[ratios.index(ratio) % len(MARKERS)] if ratio in ratios else "s"
        ax.plot(
            rows["step"],
            rows["noise_ratio"],
            marker=marker,
            markersize=3.5,
            color=compressor_color(name),
            label=_label(name, ratio),
        )
    _noise_line(ax)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_title("compression error against the gradient's sampling noise (mean over learners)")


def _ratios_per_scope(ax, summary: pd.DataFrame, steps: pd.DataFrame) -> None:
    """Each compressor's mean noise ratio per scope, against 1."""
    order = list(dict.fromkeys(steps["scope"]))
    ratios = sorted(summary["ratio"].dropna().unique(), reverse=True)
    for (name, ratio), rows in summary.groupby(["compressor", "ratio"], sort=False, dropna=False):
        marker = MARKERS[ratios.index(ratio) % len(MARKERS)] if ratio in ratios else "s"
        x = [order.index(s) for s in rows["scope"]]
        ax.plot(
            x,
            rows["noise_ratio"],
            marker,
            markersize=3.5,
            color=compressor_color(name),
            label=_label(name, ratio),
        )
    _noise_line(ax)
    _scope_axis(ax, order)
    ax.set_title("compression error against the sampling noise, mean over steps")


def _noise_line(ax) -> None:
    ax.axhline(1.0, color="0.25", linestyle="--", linewidth=1.0, label="error = sampling noise")
    ax.set_yscale("log")
    ax.set_ylabel("||C(g_i) − g_i||² / (tr(Σ) / b)")
