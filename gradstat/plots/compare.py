"""Figures of ``gradstat compare``: loss curves of dense and compressed runs side by side,
and for each compressed run its measured (online) error against the replay's open-loop
prediction, from the tables of :func:`gradstat.analysis.compare.compare`.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from gradstat.plots.style import compressor_color, legend_below, new_figure, plain_log_axis


def plot_compare(losses: pd.DataFrame, errors: pd.DataFrame) -> Figure:
    """Left: loss per learner (thin) and mean (thick) of every run. Right: relative error
    per step, measured online (solid) and predicted by the open-loop replay (dashed)."""
    fig, axes = new_figure(1, 2, width=5.5, height=4.0)
    curves, error = axes[0]
    colors = {}
    for i, (run, data) in enumerate(losses.groupby("run", sort=False)):
        label = data["label"].iloc[0]
        # the compressor's colour of every figure; a second run of it: the cycle's
        color = compressor_color(label.split(" at ")[0])
        color = color if color not in colors.values() else f"C{i % 10}"
        colors[run] = color
        for _, learner in data.groupby("learner"):
            curves.plot(learner["step"], learner["loss"], color=color, alpha=0.3, linewidth=0.7)
        mean = data.groupby("step")["loss"].mean()
        curves.plot(mean.index, mean.to_numpy(), color=color, linewidth=2, label=f"{run}: {label}")
    curves.set_xlabel("training step")
    curves.set_ylabel("loss (thin: learners, thick: mean)")
    for run, data in errors.groupby("run", sort=False):
        color = colors.get(run, "C0")
        error.plot(data["step"], data["measured_rel_error"], color=color, label=f"{run} online")
        if data["predicted_rel_error"].notna().any():
            error.plot(
                data["step"],
                data["predicted_rel_error"],
                color=color,
                linestyle="--",
                label=f"{run} replay (open-loop)",
            )
    error.set_xlabel("training step")
    error.set_ylabel("relative error ||ĝ-g||²/||g||²")
    error.set_yscale("log")
    plain_log_axis(error)
    for ax in (curves, error):  # steps are whole numbers: no tick at 2.5
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    legend_below(fig, ncols=3)  # outside the axes, never over a curve
    fig.suptitle("dense and compressed training: loss, and online error against replay")
    return fig
