"""Shared figure style and saving for every gradstat plot.

Plot functions take the tidy DataFrames that analyses return (usable from a notebook)
and return a matplotlib Figure; ``save_figure`` writes png/pdf/svg by suffix.
Matplotlib is imported here, never by ``import gradstat``.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed

import matplotlib.pyplot as plt
import seaborn as sns
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from gradstat.errors import UsageError
from gradstat.plots.paths import check_plot_path


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
    try:
        fig.savefig(path, dpi=dpi, format=path.suffix.lower().lstrip("."))
    except OSError as exc:
        raise UsageError(f"--plot {path}: cannot write ({exc.strerror})") from exc
    finally:
        plt.close(fig)
    return path
