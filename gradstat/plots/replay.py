"""Figures of a compressor replay, from the per-step records of
:func:`gradstat.analysis.replay.replay`.

Three panels: mean relative error against mean bytes per learner (one point per
compressor and rate, log-log: the trade-off a compressor designer picks from), the
relative error over steps (does error feedback keep it bounded?), and build-up ``U/k``
over steps for the sparse exchanges (ScaleCom, arXiv 2104.11125).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from gradstat.plots.style import legend_below, new_figure

MARKERS = "osD^vP*X"


def _label(compressor: str, ratio: float) -> str:
    return compressor if math.isnan(ratio) else f"{compressor} {ratio:g}"


def plot_replay(records: pd.DataFrame) -> Figure:
    """Error vs bytes, error over steps and build-up over steps (first scope only).

    Each compressor keeps one colour in every panel and each ratio one marker, named in
    one legend under the panels, so no label sits on a point or a line.
    """
    scope = records["scope"].iloc[0]
    data = records[records["scope"] == scope].copy()
    data["label"] = [_label(c, r) for c, r in zip(data["compressor"], data["ratio"], strict=True)]
    colors = {name: f"C{i}" for i, name in enumerate(data["compressor"].unique())}
    ratios = sorted(data["ratio"].dropna().unique(), reverse=True)
    markers = {r: MARKERS[i % len(MARKERS)] for i, r in enumerate(ratios)}

    def style(group: pd.DataFrame) -> dict:
        ratio = group["ratio"].iloc[0]
        marker = "o" if math.isnan(ratio) else markers[ratio]
        return {"color": colors[group["compressor"].iloc[0]], "marker": marker}

    fig, axes = new_figure(1, 3, width=5.0, height=4.0)
    trade, error, buildup = axes[0]
    for label, group in data.groupby("label", sort=False):
        look = style(group)
        trade.plot(
            group["bytes_per_learner"].mean(),
            group["rel_error"].mean(),
            ls="none",
            ms=7,
            label=label,
            **look,
        )
        error.plot(group["step"], group["rel_error"], ms=3, lw=1, **look)
        if np.isfinite(group["buildup"]).any():
            buildup.plot(group["step"], group["buildup"], ms=3, lw=1, **look)
    trade.set_xscale("log")
    if (data["rel_error"] > 0).any():
        trade.set_yscale("log")
        error.set_yscale("log")
    trade.set(
        xlabel="bytes sent per learner per step",
        ylabel="mean relative error ||ĝ - g||² / ||g||²",
        title=f"error vs traffic ({scope})",
    )
    error.set(xlabel="training step", ylabel="relative error", title="error over steps")
    buildup.set(
        xlabel="training step", ylabel="build-up U / k", title="build-up of the sparse exchanges"
    )
    legend_below(fig, trade, ncols=6)
    return fig
