"""Figure of learner consistency, from :func:`gradstat.analysis.consistency.consistency`'s
tables: the learners' mean cosine matrix, and over steps their cosines, the dispersions
of their gradient norms and losses, and gradient diversity against its two references
(1/n: identical learners; 1: orthogonal ones). Several scopes are averaged per step.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

from gradstat.analysis.consistency import cosine_matrix
from gradstat.plots.style import new_figure

#: Learners up to which the heatmap writes each cosine in its cell.
ANNOTATED = 12


def plot_consistency(steps: pd.DataFrame, pairs: pd.DataFrame) -> Figure:
    """The mean cosine matrix and the measures over steps (module docstring)."""
    fig, axes = new_figure(2, 2, width=4.6, height=3.5)
    (heat, cosine), (spread, diversity) = axes
    scopes = steps["scope"].nunique()
    where = f"scope {steps['scope'].iloc[0]}" if scopes == 1 else f"mean of {scopes} scopes"
    per_step = steps.groupby("step", sort=True).mean(numeric_only=True).reset_index()
    n = int(steps["learners"].iloc[0])
    _heatmap(heat, pairs)
    _cosines(cosine, per_step)
    _dispersions(spread, per_step)
    _diversity(diversity, per_step, n)
    for ax in (cosine, spread, diversity):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("training step")
        ax.legend(fontsize="small", frameon=False)
    fig.suptitle(f"learner consistency, {n} learners, {where}", fontsize="medium")
    return fig


def _cosines(ax, per_step: pd.DataFrame) -> None:
    steps = per_step["step"]
    ax.plot(steps, per_step["cosine_mean"], marker="o", markersize=3, label="mean over pairs")
    ax.plot(
        steps, per_step["cosine_min"], marker="v", markersize=3, linestyle="--", label="lowest pair"
    )
    ax.axhline(0.0, color="0.6", linewidth=0.8)
    ax.set_ylabel("cosine of two learners' gradients")
    ax.set_title("pairwise cosine per step")


def _dispersions(ax, per_step: pd.DataFrame) -> None:
    steps = per_step["step"]
    ax.plot(steps, per_step["norm_cv"], marker="o", markersize=3, label="gradient norms")
    if per_step["loss_cv"].notna().any():
        ax.plot(steps, per_step["loss_cv"], marker="s", markersize=3, label="losses")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_ylim(bottom=0)
    ax.set_ylabel("coefficient of variation over learners")
    ax.set_title("dispersion across learners per step")


def _diversity(ax, per_step: pd.DataFrame, n: int) -> None:
    ax.plot(
        per_step["step"],
        per_step["diversity"],
        marker="o",
        markersize=3,
        color="C3",
        label="diversity",
    )
    label = f"identical learners (1/n = {1 / n:.3g})"
    ax.axhline(1 / n, color="0.3", linestyle=":", linewidth=1.0, label=label)
    ax.axhline(1.0, color="0.3", linestyle="--", linewidth=1.0, label="orthogonal learners (1)")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("Σ||g_i||² / ||Σ g_i||²")
    ax.set_title("gradient diversity per step")


def _heatmap(ax, pairs: pd.DataFrame) -> None:
    """The learners' cosine matrix, mean over steps (and scopes), on a diverging scale
    centred at 0; the diagonal (1) is left blank so the pairs use the whole scale."""
    matrix = cosine_matrix(pairs).astype(float)
    off = matrix.to_numpy()[~np.eye(len(matrix), dtype=bool)]
    reach = max(0.05, float(np.nanmax(np.abs(off))))
    sns.heatmap(
        matrix,
        ax=ax,
        mask=np.eye(len(matrix), dtype=bool),
        vmin=-reach,
        vmax=reach,
        center=0.0,
        annot=len(matrix) <= ANNOTATED,
        fmt=".2f",
        cmap="RdBu_r",
        square=True,
        cbar_kws={"label": "cosine"},
        annot_kws={"fontsize": 7},
    )
    ax.grid(False)
    ax.set_xlabel("learner")
    ax.set_ylabel("learner")
    ax.set_title(f"mean cosine over {pairs['step'].nunique()} steps")
