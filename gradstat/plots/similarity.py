"""Figures of top-k set similarity, build-up and temporal overlap (from the analyses' tables).

Each function takes the DataFrames returned by ``gradstat.analysis.similarity``,
``.buildup`` or ``.overlap`` and returns a matplotlib Figure; several scopes are averaged.
"""

from __future__ import annotations

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gradstat.analysis.similarity import overlap_matrix
from gradstat.plots.style import legend_below, new_figure


def _scopes_note(df: pd.DataFrame) -> str:
    scopes = df["scope"].nunique()
    return f", mean of {scopes} scopes" if scopes > 1 else f", scope {df['scope'].iloc[0]}"


def plot_similarity(pairs: pd.DataFrame) -> Figure:
    """Heatmap of the mean learner x learner overlap (with the mean gradient's set), and
    each learner's overlap with the mean gradient's top-k over steps, against random."""
    fig, axes = new_figure(1, 2, width=5.5, height=4.2)
    heat, line = axes[0]
    matrix = overlap_matrix(pairs)
    sns.heatmap(
        matrix.astype(float),
        ax=heat,
        vmin=0.0,
        vmax=1.0,
        annot=len(matrix) <= 12,
        fmt=".2f",
        cmap="viridis",
        square=True,
        cbar_kws={"label": "overlap |A n B| / k"},
    )
    heat.set_title(f"mean top-k overlap over {pairs['step'].nunique()} steps{_scopes_note(pairs)}")
    heat.set_xlabel("learner")
    heat.set_ylabel("learner")
    glob = pairs[pairs["learner_b"] == "mean"]
    per_step = glob.groupby(["learner_a", "step"], sort=False)["overlap"].mean().reset_index()
    for learner, rows in per_step.groupby("learner_a", sort=False):
        line.plot(
            rows["step"], rows["overlap"], marker="o", markersize=3, label=f"learner {learner}"
        )
    line.axhline(pairs["random_overlap"].mean(), color="grey", linestyle="--", label="random (k/d)")
    line.set_ylim(0.0, 1.02)
    line.xaxis.set_major_locator(MaxNLocator(integer=True))
    line.set_xlabel("training step")
    line.set_ylabel("overlap with top-k of the mean")
    line.set_title(f"overlap with the mean gradient's top-k (ratio {pairs['ratio'].iloc[0]:g})")
    legend_below(fig, line, ncols=5)
    return fig


def plot_buildup(records: pd.DataFrame) -> Figure:
    """B(m) against m per ratio (mean over steps, band min..max), random baseline dashed."""
    fig, axes = new_figure(1, 1, width=6.0, height=4.2)
    ax = axes[0, 0]
    palette = sns.color_palette(n_colors=records["ratio"].nunique())
    for color, (ratio, rows) in zip(palette, records.groupby("ratio", sort=False), strict=True):
        by_m = rows.groupby("m")
        stats = by_m["buildup"].agg(["mean", "min", "max"])
        ax.plot(stats.index, stats["mean"], marker="o", color=color, label=f"ratio {ratio:g}")
        ax.fill_between(stats.index, stats["min"], stats["max"], color=color, alpha=0.2)
        ax.plot(
            stats.index,
            by_m["random_buildup"].mean(),
            linestyle="--",
            marker="x",
            color=color,
            zorder=3,
            label=f"random sets, ratio {ratio:g}",
        )
    top = int(records["m"].max())
    # Under the random baselines (they lie just below B = m at small ratios).
    ax.plot(
        [1, top],
        [1, top],
        color="0.6",
        linewidth=3,
        alpha=0.4,
        zorder=1,
        label="disjoint sets (B = m)",
    )
    ax.set_xlabel("learners m")
    ax.set_ylabel("build-up B(m) = E[U(m)] / k")
    ax.set_xticks(range(1, top + 1))
    ax.set_title(
        f"build-up over {records['step'].nunique()} steps{_scopes_note(records)} (band: min..max)"
    )
    legend_below(fig, ax, ncols=3)
    return fig


def plot_overlap(records: pd.DataFrame) -> Figure:
    """Overlap of top-k sets between step t and t + lag, per learner and for the mean."""
    fig, axes = new_figure(1, 1, width=6.5, height=4.2)
    ax = axes[0, 0]
    per_step = records.groupby(["learner", "step"], sort=False)["overlap"].mean().reset_index()
    for learner, rows in per_step.groupby("learner", sort=False):
        is_mean = learner == "mean"
        ax.plot(
            rows["step"],
            rows["overlap"],
            marker="o",
            markersize=3,
            linewidth=2.0 if is_mean else 1.0,
            color="black" if is_mean else None,
            label="mean gradient" if is_mean else f"learner {learner}",
        )
    ax.axhline(records["random_overlap"].mean(), color="grey", linestyle="--", label="random (k/d)")
    gaps = records["gap"]
    gap = f"{gaps.min()}" if gaps.min() == gaps.max() else f"{gaps.min()}..{gaps.max()}"
    ax.set_ylim(0.0, 1.02)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step t")
    ax.set_ylabel("overlap of top-k(t) and top-k(t + gap)")
    ax.set_title(
        f"temporal overlap, ratio {records['ratio'].iloc[0]:g}, training-step gap {gap}"
        f"{_scopes_note(records)}"
    )
    legend_below(fig, ax, ncols=4)
    return fig
