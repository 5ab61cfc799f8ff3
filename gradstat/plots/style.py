"""Shared figure style and saving for every gradstat plot.

Plot functions take the tidy DataFrames that analyses return (usable from a notebook)
and return a matplotlib Figure; ``save_figure`` writes png/pdf/svg by suffix.
Matplotlib is imported here, never by ``import gradstat``.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed

import matplotlib.pyplot as plt
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

from gradstat.atomic import replacing
from gradstat.plots.paths import check_plot_path

#: One colour per compressor in every figure (seaborn's colorblind palette, then tab20):
#: topk is the same blue in replay.png, the report and compare. Other names (a user's
#: compressor) take a stable tab20 colour from their name.
_COLORBLIND = sns.color_palette("colorblind", 10).as_hex()
_TAB20 = sns.color_palette("tab20", 20).as_hex()
COMPRESSOR_COLORS = {
    "topk": _COLORBLIND[0],
    "dgc": _COLORBLIND[1],
    "sidco-gpd": _COLORBLIND[2],
    "clt-k": _COLORBLIND[3],
    "powersgd": _COLORBLIND[4],
    "fp16": _COLORBLIND[5],
    "bf16": _COLORBLIND[7],
    "none": "#333333",
    "dense": "#333333",
    "gtopk": _COLORBLIND[9],
    "randomk": _COLORBLIND[6],
    "sidco-exp": _COLORBLIND[8],
    "sidco-gamma-gpd": _TAB20[5],
    "threshold": _TAB20[15],
    "gaussiank": _TAB20[17],
    "redsync": _TAB20[19],
    "redsync-sidco": _TAB20[13],
    "signsgd": _TAB20[11],
    "ef-signsgd": _TAB20[9],
    "qsgd": _TAB20[7],
    "terngrad": _TAB20[3],
}


def compressor_color(name: str) -> str:
    """The colour of compressor ``name`` (a label such as ``topk:memory=none`` by its
    name) in every gradstat figure."""
    base = str(name).split(":")[0].split(" ")[0]
    if base in COMPRESSOR_COLORS:
        return COMPRESSOR_COLORS[base]
    return _TAB20[zlib.crc32(base.encode()) % len(_TAB20)]


def plain_log_axis(ax, which: str = "y") -> None:
    """Major ticks at 1, 2 and 5 x 10^n labelled as plain numbers (0.5, 2, 10), minor
    ticks unlabelled, on ``ax``'s ``which`` axis when it is a log axis spanning under two
    decades (which otherwise labels its minor ticks as 6x10^0, 4x10^0)."""
    axis = ax.yaxis if which == "y" else ax.xaxis
    low, high = ax.get_ylim() if which == "y" else ax.get_xlim()
    if axis.get_scale() != "log" or min(low, high) <= 0 or math.log10(high / low) > 2:
        return
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def new_figure(nrows: int = 1, ncols: int = 1, *, width: float = 6.0, height: float = 4.0):
    """A seaborn-styled figure with a grid of axes (always a 2-D array of axes)."""
    sns.set_theme(context="paper", style="whitegrid", palette="colorblind")
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False, layout="constrained"
    )
    return fig, axes


def legend_below(fig: Figure, ax=None, ncols: int = 4) -> None:
    """One legend under the axes grid (never over data): of ``ax`` or of all axes."""
    axes = [ax] if ax is not None else fig.axes
    seen: dict[str, object] = {}
    for one in axes:
        for handle, label in zip(*one.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    if seen:
        fig.legend(
            list(seen.values()),
            list(seen),
            loc="outside lower center",
            ncols=min(ncols, len(seen)),
            fontsize="small",
            frameon=False,
        )


def _skip_invisible_minor_ticks(fig: Figure) -> None:
    """No minor-tick locators on log axes that span over 2 decades, where seaborn's
    whitegrid draws no tick marks or grid lines and matplotlib's log formatter labels
    no minor tick: placing and measuring those invisible ticks took 80% of the time to
    save a 9-panel fit figure, for the same pixels."""
    for ax in fig.axes:
        for axis, limits in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            if axis.get_scale() != "log" or min(limits) <= 0:
                continue
            tick = axis.get_minor_ticks(1)[0]
            marks = (tick.tick1line, tick.tick2line, tick.gridline)
            span = math.log10(max(limits) / min(limits))
            if span > 2 and not any(mark.get_visible() for mark in marks):
                axis.set_minor_locator(NullLocator())


def save_figure(fig: Figure, path: Path | str, dpi: int = 150) -> Path:
    """Write ``fig`` to ``path`` (format by suffix) and close it."""
    path = check_plot_path(path)
    _skip_invisible_minor_ticks(fig)
    try:  # whole or not at all: a full disk leaves no half figure (gradstat/atomic.py)
        with replacing(path, "--plot") as handle:
            fig.savefig(handle, dpi=dpi, format=path.suffix.lower().lstrip("."))
    finally:
        plt.close(fig)
    return path
