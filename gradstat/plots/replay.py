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

from gradstat.plots.style import new_figure


def _label(compressor: str, ratio: float) -> str:
    return compressor if math.isnan(ratio) else f"{compressor} {ratio:g}"


def plot_replay(records: pd.DataFrame) -> Figure:
    """Error vs bytes, error over steps and build-up over steps (first scope only)."""
    scope = records["scope"].iloc[0]
    data = records[records["scope"] == scope].copy()
    data["label"] = [_label(c, r) for c, r in zip(data["compressor"], data["ratio"], strict=True)]
    fig, axes = new_figure(1, 3, width=5.0, height=4.0)
    trade, error, buildup = axes[0]
    summary = data.groupby("label", sort=False)[["bytes_per_learner", "rel_error"]].mean()
    for label, row in summary.iterrows():
        trade.scatter(row["bytes_per_learner"], row["rel_error"], label=label)
        trade.annotate(
            label,
            (row["bytes_per_learner"], row["rel_error"]),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    trade.set_xscale("log")
    if (summary["rel_error"] > 0).any():
        trade.set_yscale("log")
    trade.set_xlabel("bytes sent per learner per step")
    trade.set_ylabel("mean relative error ||ĝ - g||² / ||g||²")
    trade.set_title(f"error vs traffic ({scope})")
    for label, group in data.groupby("label", sort=False):
        error.plot(group["step"], group["rel_error"], marker=".", label=label)
        if np.isfinite(group["buildup"]).any():
            buildup.plot(group["step"], group["buildup"], marker=".", label=label)
    if (data["rel_error"] > 0).any():
        error.set_yscale("log")
    error.set_xlabel("step")
    error.set_ylabel("relative error")
    error.set_title("error over steps")
    error.legend(fontsize=7)
    buildup.set_xlabel("step")
    buildup.set_ylabel("build-up U / k")
    buildup.set_title("build-up of the sparse exchanges")
    if buildup.lines:
        buildup.legend(fontsize=7)
    return fig
