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


def random_baseline(ax, level: float) -> None:
    """The overlap of random sets (k/d, often 0.001) as a dark dashed line labelled on
    the plot, on a y axis that starts a little below 0 so the line is not hidden in the
    x axis."""
    ax.axhline(
        level, color="0.25", linestyle="--", linewidth=1.2, label=f"random sets ({level:.2%})"
    )
    ax.annotate(
        f"random sets: {level:.2%}",
        (1.0, level),
        xycoords=("axes fraction", "data"),
        xytext=(-4, 3),
        textcoords="offset points",
        ha="right",
        va="bottom",
        fontsize=7,
        color="0.25",
    )
    ax.set_ylim(-0.04, 1.02)


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
        cbar_kws={"label": "overlap |A ∩ B| / k"},
    )
    heat.set_title(
        f"mean top-k overlap, ratio {pairs['ratio'].iloc[0]:g}, over "
        f"{pairs['step'].nunique()} steps{_scopes_note(pairs)}"
    )
    heat.set_xlabel("learner")
    heat.set_ylabel("learner")
    glob = pairs[pairs["learner_b"] == "mean"]
    per_step = glob.groupby(["learner_a", "step"], sort=False)["overlap"].mean().reset_index()
    for learner, rows in per_step.groupby("learner_a", sort=False):
        line.plot(
            rows["step"], rows["overlap"], marker="o", markersize=3, label=f"learner {learner}"
        )
    random_baseline(line, pairs["random_overlap"].mean())
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
    groups = records.groupby("ratio", sort=False)
    for i, (color, (ratio, rows)) in enumerate(zip(palette, groups, strict=True)):
        by_m = rows.groupby("m")
        stats = by_m["buildup"].agg(["mean", "min", "max"])
        # min..max over steps as error bars, offset a little per ratio: bands of two
        # ratios blend into one colour and hide the B = m line
        shift = 0.06 * (i - 0.5 * (len(groups) - 1))
        ax.errorbar(
            stats.index + shift,
            stats["mean"],
            yerr=[stats["mean"] - stats["min"], stats["max"] - stats["mean"]],
            marker="o",
            color=color,
            capsize=4,
            label=f"ratio {ratio:g}",
        )
        ax.plot(
            stats.index,
            by_m["random_buildup"].mean(),
            linestyle="--",
            marker="x",
            color=color,
            zorder=3,
            label=f"random, ratio {ratio:g}",
        )
    top = int(records["m"].max())
    # Over everything, thin and dark: the random baselines lie just below it.
    ax.plot(
        [1, top],
        [1, top],
        color="0.2",
        linewidth=1.0,
        linestyle=":",
        zorder=4,
        label="disjoint sets (B = m)",
    )
    ax.set_xlabel("learners m")
    ax.set_ylabel("build-up B(m) = E[U(m)] / k")
    ax.set_xticks(range(1, top + 1))
    ax.set_title(
        f"build-up over {records['step'].nunique()} steps{_scopes_note(records)}; "
        "bars: min..max over steps"
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
    random_baseline(ax, records["random_overlap"].mean())
    gaps = records["gap"]
    gap = f"{gaps.min()}" if gaps.min() == gaps.max() else f"{gaps.min()}..{gaps.max()}"
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step t")
    ax.set_ylabel("overlap of top-k(t) and top-k(t + gap)")
    ax.set_title(
        f"temporal overlap, ratio {records['ratio'].iloc[0]:g}, training-step gap {gap}"
        f"{_scopes_note(records)}"
    )
    legend_below(fig, ax, ncols=4)
    return fig
